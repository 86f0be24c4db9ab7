"""``precision.dtype=auto`` (seektrain/platform/compute_dtype.py): bf16 only where the device multiplies it
natively, fp32 elsewhere, decided from what the machine says about itself; and the emulation variables
of an AVX2-only CPU count as what they emulate."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from seektrain.config.loader import load_config
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan.hardware import GPUS, cpu_hardware
from seektrain.plan.run_plan import RunPlan
from seektrain.plan.search import planned_precision
from seektrain.platform import policy_for
from seektrain.platform.compute_dtype import CpuFacts, choose_dtype, cpu_choice, cuda_choice

AVX512 = frozenset({"avx2", "avx512f", "avx512bw"})


def facts(*flags: str, vendor: str = "GenuineIntel", capability: str = "AVX512", isa: str = "") -> CpuFacts:
    return CpuFacts(AVX512 | set(flags), vendor, capability, isa)


@pytest.mark.parametrize(
    "cpu, dtype, needle",
    [
        (CpuFacts(frozenset({"avx", "avx2", "fma"}), "AuthenticAMD", "AVX2", ""), "fp32", "AVX2"),
        (facts(capability="AVX512"), "fp32", "no native bf16"),
        (facts("avx512_bf16", "amx_bf16", "amx_tile"), "bf16", "amx_bf16"),
        (facts("avx512_bf16", vendor="AuthenticAMD"), "bf16", "AMD avx512_bf16"),
        (facts("avx512_bf16"), "fp32", "without AMX"),  # this Xeon under KVM: bf16 matmuls at ~0.55x fp32
        # the emulation of an AVX2-only CPU on an AMX machine
        (facts("avx512_bf16", "amx_bf16", capability="AVX2", isa="AVX2"), "fp32", "ONEDNN_MAX_CPU_ISA=AVX2"),
        (facts("avx512_bf16", "amx_bf16", capability="AVX2"), "fp32", "AVX2"),
        (facts("avx512_bf16", "amx_bf16", isa="avx512_core_vnni"), "fp32", "ONEDNN_MAX_CPU_ISA"),
        (facts("avx512_bf16", "amx_bf16", isa="AVX512_CORE_AMX"), "bf16", "amx_bf16"),
    ],
)
def test_cpu_rule(cpu, dtype, needle):
    got = cpu_choice(cpu)
    assert (
        got.name == dtype and got.why.startswith(f"precision.dtype=auto -> {dtype}: ") and needle in got.why
    )


@pytest.mark.parametrize(
    "capability, dtype",
    [((9, 0), "bf16"), ((8, 0), "bf16"), ((8, 6), "bf16"), ((7, 5), "fp32"), ((7, 0), "fp32")],
)
def test_cuda_rule(capability, dtype):
    """sm80+ has bf16 tensor cores; below, fp32 rather than fp16 (which needs a loss scale and may overflow:
    an unattended default must not risk it); the line says fp16 is there to be asked for."""
    got = cuda_choice(capability, "GPU X")
    assert got.name == dtype and "GPU X" in got.why
    assert ("fp16" in got.why) == (dtype == "fp32")


def test_a_plan_for_a_gpu_this_process_cannot_see_takes_bf16():
    """``RunPlan.resolve(..., "cuda")`` runs without a GPU (the planner, the layout tests)."""
    if torch.cuda.is_available():
        assert choose_dtype("auto", "cuda") == cuda_choice(
            torch.cuda.get_device_capability(), torch.cuda.get_device_name()
        )
    else:
        assert choose_dtype("auto", "cuda").name == "bf16"


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_an_explicit_dtype_is_kept_on_any_device(name):
    assert choose_dtype(name, "cpu").name == name and "set explicitly" in choose_dtype(name, "cuda").why


def test_the_emulation_variables_reach_the_decision():
    """The real detection in a fresh process (torch reads ATEN_CPU_CAPABILITY at start-up)."""
    code = (
        "from seektrain.platform.compute_dtype import choose_dtype, this_cpu; "
        "c = choose_dtype('auto', 'cpu'); print(this_cpu().aten_capability, c.name, c.why)"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    capability, name, why = out.stdout.split(" ", 2)
    assert capability == "AVX2" and name == "fp32" and "ONEDNN_MAX_CPU_ISA=AVX2" in why


def test_the_default_is_auto_and_the_plan_decides_it():
    job = load_config(None, [])
    assert job.precision.dtype == "auto"
    plan = RunPlan.resolve(job, get_preset("tiny-v3"), 1, "cpu")
    assert job.precision.dtype == "auto"  # the config keeps it; the plan holds the decision
    assert plan.precision == choose_dtype("auto", "cpu")
    assert plan.compute_dtype == plan.precision.torch_dtype


def test_the_planner_plans_auto_as_bf16_on_its_gpus():
    job = load_config(None, [])
    assert {planned_precision(job, hw).name for hw in GPUS.values()} == {"bf16"}
    assert planned_precision(job, cpu_hardware(1, measure=False)) == choose_dtype("auto", "cpu")
    fp16 = load_config(None, ["precision.dtype=fp16"])
    assert planned_precision(fp16, GPUS["h100-80g"]).name == "fp16"


def test_the_cpu_kernels_pad_expert_rows_only_where_onednn_multiplies():
    """bf16/fp16 matmuls are oneDNN's, which compiles a kernel per shape (the padding bounds the shapes);
    fp32 ones are MKL's, where the padding is only extra rows. Both keep the value-padded attention."""
    policy, plain = policy_for("cpu"), policy_for("cpu").model_kernels(torch.float32)
    assert plain.expert_row_multiple == 1 and policy.model_kernels(torch.bfloat16).expert_row_multiple == 16
    assert policy.model_kernels(torch.float16).expert_row_multiple == 16
    assert plain.attention is policy.model_kernels(torch.bfloat16).attention
    assert policy_for("cuda").model_kernels(torch.float32) == policy_for("cuda").model_kernels()
