"""The platform boundary: the generic policy (CUDA, meta, ...) loads no CPU-only code, the model code has
no device branch, the CPU policy's kernels compute what the default kernels compute, and the CPU
policy's process settings and FSDP collectives take effect where asked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import seektrain.models
from seektrain.models import build_model, get_preset
from seektrain.models.flex_attention import document_block_mask, flex_causal_attention
from seektrain.models.kernels import Kernels
from seektrain.observe.counting import ModuleFlopCounter
from seektrain.platform import PlatformPolicy, policy_for
from seektrain.platform import cpu_policy as cpu_policy_module
from tolerances import model_rel, model_tol

ROOT = Path(__file__).resolve().parents[1]

_LOADED_CPU_MODULES = """
import sys, torch
import seektrain.models, seektrain.observe.counting, seektrain.parallel.data_parallel
from seektrain.models import build_model, get_preset
from seektrain.platform import policy_for
for name in sys.argv[1:]:
    policy = policy_for(torch.device(name))
    build_model(get_preset("tiny-v3"), device="meta", kernels=policy.model_kernels())
print(" ".join(sorted(m for m in sys.modules if m.startswith("seektrain.platform.cpu") or "gloo_collectives" in m)))
"""


def _cpu_modules_loaded(*devices: str) -> set[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _LOADED_CPU_MODULES, *devices],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=ROOT,
    )
    return set(out.stdout.split())


def test_generic_policy_imports_no_cpu_module():
    assert _cpu_modules_loaded("cuda", "meta") == set()
    # the probe does see them once a CPU device asks
    loaded = _cpu_modules_loaded("cuda", "cpu")
    assert {"seektrain.platform.cpu_policy", "seektrain.platform.cpu_gloo_collectives"} <= loaded


def test_generic_policy_does_nothing_special():
    policy = policy_for(torch.device("cuda"))
    kernels = policy.model_kernels()
    assert type(policy) is PlatformPolicy and kernels.expert_row_multiple == Kernels().expert_row_multiple
    # only packed rows (a document mask) take another kernel: FlexAttention, loaded at its first use
    assert kernels.document_mask is document_block_mask and kernels.attention is flex_causal_attention
    if not torch.cuda.is_available():  # the experts' grouped GEMM is the platform's choice: none without CUDA
        assert kernels.grouped_mm_dtypes == ()
    assert type(policy_for("meta")) is PlatformPolicy
    assert isinstance(policy_for("cpu"), cpu_policy_module.CpuPolicy)


def test_model_code_has_no_device_branch():
    """A tensor's device type is never tested in models/ (``device.type == "cpu"``, ``x.is_cuda``, ...), nor a
    CUDA property read (``torch.cuda.get_device_capability``),
    and models/ does not import the platform package: platform choices arrive as ``Kernels``."""
    branch = re.compile(r"device\.type\s*(==|!=|in\b|not in\b)|\.is_cpu\b|\.is_cuda\b|torch\.cuda\.")
    imports = re.compile(r"^\s*(from|import)\s+seektrain\.platform", re.M)
    offenders = []
    for path in Path(seektrain.models.__file__).parent.glob("*.py"):
        text = path.read_text()
        offenders += [f"{path.name}: {line.strip()}" for line in text.splitlines() if branch.search(line)]
        if imports.search(text):
            offenders.append(f"{path.name} imports seektrain.platform")
    assert not offenders, offenders


def _loss_and_grads(model, tokens):
    losses = model(tokens, mtp_tokens=tokens, labels=tokens)
    (losses.loss_sum + sum(losses.mtp)).backward()
    return losses, {name: p.grad for name, p in model.named_parameters()}


def test_cpu_kernels_give_default_outputs_and_gradients():
    cfg = get_preset("tiny-v3")
    assert cfg.v_head_dim < cfg.qk_head_dim and cfg.is_moe  # both CPU paddings have work to do
    cpu = policy_for("cpu").model_kernels()
    assert cpu != Kernels() and cpu.expert_row_multiple > 1
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    plain, padded = build_model(cfg, seed=3), build_model(cfg, seed=3, kernels=cpu)
    with ModuleFlopCounter(plain) as plain_count:
        plain_losses, plain_grads = _loss_and_grads(plain, tokens)
    with ModuleFlopCounter(padded) as padded_count:
        padded_losses, padded_grads = _loss_and_grads(padded, tokens)
    assert padded_count.total > plain_count.total  # the padded paths did run
    rel = model_rel(cfg, 40)  # padding changes only the reduction order
    torch.testing.assert_close(padded_losses.loss_sum, plain_losses.loss_sum, rtol=rel, atol=0)
    torch.testing.assert_close(padded_losses.mtp, plain_losses.mtp, rtol=rel, atol=0)
    for name, grad in plain_grads.items():  # equal up to rounding (measured: within 1.1e-6 of the scale)
        assert grad is not None and grad.abs().max() > 0, name
        tol = model_tol(cfg, 40, grad.abs().max(), backward=True)
        torch.testing.assert_close(padded_grads[name], grad, **tol, msg=lambda m, name=name: f"{name}: {m}")


_PREPARE = """
import os, sys
from seektrain.platform import policy_for
policy = policy_for("cpu")
policy.prepare_process(deterministic=sys.argv[1] == "1", keep_freed_memory=sys.argv[2] == "1")
policy.end_of_step()
print(os.environ.get("MKL_CBWR", "-"), policy.trims_memory)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_cpu_policy_prepares_the_process_as_asked():
    clean = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    assert _prepare_in(clean, True, True) == ["AUTO,STRICT", "True"]
    assert _prepare_in(clean, False, False) == ["-", "False"]
    assert _prepare_in(dict(clean, MKL_CBWR="COMPATIBLE"), True, False) == [
        "COMPATIBLE",
        "False",
    ]  # user wins


def _prepare_in(env: dict, deterministic: bool, keep: bool) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PREPARE, str(int(deterministic)), str(int(keep))],
        capture_output=True,
        text=True,
        check=True,
        env=dict(env, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    return out.stdout.split()


@pytest.mark.parametrize(
    "backend,param,reduce,wire",
    [
        ("gloo", torch.bfloat16, torch.float32, torch.bfloat16),  # bf16-exact fp32 chunks travel as bf16
        ("gloo", torch.float16, torch.float32, torch.float16),
        ("gloo", torch.bfloat16, torch.bfloat16, None),
        ("gloo", torch.float32, torch.float32, None),
        ("nccl", torch.bfloat16, torch.float32, "untouched"),
    ],
)
def test_cpu_policy_gives_fsdp_point_to_point_collectives_on_gloo(monkeypatch, backend, param, reduce, wire):
    calls = []
    monkeypatch.setattr(cpu_policy_module.dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(
        cpu_policy_module, "use_p2p_collectives", lambda m, wire_dtype: calls.append((m, wire_dtype))
    )
    module = torch.nn.Linear(2, 2)
    policy_for("cpu").configure_fsdp(module, MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce))
    assert calls == ([] if wire == "untouched" else [(module, wire)])
