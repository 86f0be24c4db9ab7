"""``precision.dtype = auto``: the compute dtype this device runs fastest, decided once per process.

Why: bf16 is only faster where the hardware multiplies it natively. On an AMD EPYC with AVX2 only, a
bf16 2048² matmul ran at 0.1-0.4 GFLOP/s against 14-34 in fp32, and the default run trained 4-5x slower
in bf16 than in fp32. So ``auto`` means:

- CUDA: bf16 from compute capability 8.0 (Ampere) on, which has bf16 tensor cores; fp32 below. Not fp16
  on Volta/Turing: fp16 needs a loss scale and can overflow, which an unattended default must not risk;
  ask for ``precision.dtype=fp16`` there yourself.
- CPU: bf16 where oneDNN has a bf16 matrix unit it may use: AMX (``amx_bf16``), or AVX512_BF16 on AMD
  (Zen 4 and later: ~415 bf16 against ~190 fp32 GFLOP/s on 2 threads). fp32 elsewhere: on AVX2 there is
  no bf16 arithmetic at all, and an Intel CPU whose only bf16 unit is AVX512_BF16 (no AMX; a virtual
  machine may hide it) multiplied bf16 at about half its fp32 rate (``docs/benchmarks.md``).
  ``ATEN_CPU_CAPABILITY`` or ``ONEDNN_MAX_CPU_ISA`` (``DNNL_MAX_CPU_ISA``) capped below AVX-512 BF16
  mean the kernels will not use the unit, so they count as "no native bf16" too; that is also how an
  AVX2-only CPU is emulated on a bigger one.

The decision depends only on what the machine says about itself (flags, vendor, capability, those
variables), never on a timing probe, so every rank of a run on identical hardware decides alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from seektrain.config.dtypes import DTYPES

# ONEDNN_MAX_CPU_ISA values (lower case) that keep oneDNN's bf16 kernels: every ISA from AVX512_CORE_BF16
# up (AVX512_CORE_FP16, the AMX ones, AVX10.x) and the "no cap" spellings
_BF16_ISAS = ("avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx", "avx10", "all", "default")


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # fp32 | bf16 | fp16: the key of seektrain.config.dtypes.DTYPES
    why: str  # one line for the start-up log

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.name]


@dataclass(frozen=True)
class CpuFacts:
    """What a CPU says about itself, the inputs of the CPU rule (tests build their own)."""

    flags: frozenset[str]  # /proc/cpuinfo "flags"
    vendor: str  # /proc/cpuinfo "vendor_id": GenuineIntel | AuthenticAMD | ...
    aten_capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT | AVX2 | AVX512 | ...
    onednn_max_isa: str  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), "" when unset


def this_cpu() -> CpuFacts:
    flags: set[str] = set()
    vendor = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                if flags and vendor:
                    break
    except OSError:  # not Linux: no flags known, so no native bf16 is assumed
        pass
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return CpuFacts(frozenset(flags), vendor, torch.backends.cpu.get_cpu_capability(), isa)


def cpu_choice(facts: CpuFacts) -> DtypeChoice:
    """The CPU rule of the module docstring."""
    if facts.onednn_max_isa and not facts.onednn_max_isa.lower().startswith(_BF16_ISAS):
        return DtypeChoice(
            "fp32",
            f"precision.dtype=auto -> fp32: ONEDNN_MAX_CPU_ISA={facts.onednn_max_isa} "
            "keeps oneDNN off the CPU's bf16 instructions",
        )
    if not facts.aten_capability.upper().startswith("AVX512"):
        return DtypeChoice(
            "fp32",
            f"precision.dtype=auto -> fp32: torch's CPU kernels run at "
            f"{facts.aten_capability}, without native bf16",
        )
    if "amx_bf16" in facts.flags:
        return DtypeChoice(
            "bf16", "precision.dtype=auto -> bf16: this CPU multiplies bf16 natively (amx_bf16)"
        )
    if "avx512_bf16" in facts.flags and facts.vendor == "AuthenticAMD":
        return DtypeChoice(
            "bf16", "precision.dtype=auto -> bf16: this CPU multiplies bf16 natively (AMD avx512_bf16)"
        )
    if "avx512_bf16" in facts.flags:
        return DtypeChoice(
            "fp32",
            "precision.dtype=auto -> fp32: this CPU's only bf16 unit is avx512_bf16 "
            "without AMX, where bf16 matmuls run slower than fp32",
        )
    return DtypeChoice(
        "fp32", "precision.dtype=auto -> fp32: this CPU has no native bf16 (no avx512_bf16/amx_bf16)"
    )


def cuda_choice(capability: tuple[int, int], name: str = "this GPU") -> DtypeChoice:
    major, minor = capability
    if major >= 8:
        return DtypeChoice(
            "bf16", f"precision.dtype=auto -> bf16: {name} (sm{major}{minor}) has bf16 tensor cores"
        )
    return DtypeChoice(
        "fp32",
        f"precision.dtype=auto -> fp32: {name} (sm{major}{minor}) has no bf16 tensor "
        "cores; precision.dtype=fp16 (with a loss scale) may be faster",
    )


def choose_dtype(requested: str, device_type: str) -> DtypeChoice:
    """The compute dtype for ``precision.dtype=requested`` on this process's ``device_type``: an explicit
    dtype is kept as it is; ``auto`` follows the rules above."""
    if requested != "auto":
        return DtypeChoice(requested, f"precision.dtype={requested} (set explicitly)")
    if device_type == "cuda":
        if not torch.cuda.is_available():  # a plan for a GPU this process cannot see (planner, tests)
            return DtypeChoice("bf16", "precision.dtype=auto -> bf16: no GPU visible here, planned as sm80+")
        return cuda_choice(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    if device_type == "cpu":
        return cpu_choice(this_cpu())
    return DtypeChoice("fp32", f"precision.dtype=auto -> fp32: no bf16 rule for device type {device_type!r}")
