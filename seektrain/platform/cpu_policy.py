"""The CPU policy: reproducible MKL math, glibc's allocator kept warm, point-to-point FSDP collectives on
gloo, and the CPU model kernels. Each workaround's measurements are in the module that implements it."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from seektrain.models.kernels import Kernels
from seektrain.platform import cpu_allocator
from seektrain.platform.cpu_gloo_collectives import use_p2p_collectives
from seektrain.platform.cpu_kernels import cpu_kernels
from seektrain.platform.policy import PlatformPolicy

log = logging.getLogger("seektrain.platform")


def reproducible_mkl_math() -> None:
    """Make MKL's fp32 kernels bit-reproducible in this process (for ``train.deterministic``).

    Why: MKL picks code paths by memory alignment, so two identical CPU runs differ in the last bits
    from step 1 on (measured: ~1e-7 relative in the loss) and no resume can equal "the" uninterrupted
    run. ``MKL_CBWR=AUTO,STRICT`` (conditional numerical reproducibility) removes that, at ~20% sgemm
    speed. MKL reads the variable at its first call, so this must run before any matmul; a value the
    user set wins.
    """
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


class CpuPolicy(PlatformPolicy):
    def __init__(self) -> None:
        self.trims_memory = False  # whether glibc was switched to keep freed memory

    def prepare_process(self, deterministic: bool, keep_freed_memory: bool) -> None:
        if deterministic:
            reproducible_mkl_math()
        if keep_freed_memory:
            self.trims_memory = cpu_allocator.keep_freed_memory()
            if not self.trims_memory:
                log.info("cpu.keep_freed_memory: no glibc malloc here, left as it is")

    def end_of_step(self) -> None:
        if self.trims_memory:
            cpu_allocator.release_free_memory()

    def pin_host_memory(self) -> bool:
        """The device is the host: nothing to pin (and a CPU-only torch cannot pin at all)."""
        return False

    def configure_fsdp(self, module: nn.Module, mp_policy: MixedPrecisionPolicy) -> None:
        """gloo's all-gather and reduce-scatter are slow on one host: swap in point-to-point ones
        (``cpu_gloo_collectives.py``). Under bf16/fp16 compute with fp32 reduction, gradient chunks
        that are exact low-precision values travel in that dtype (half the bytes, the same sums)."""
        if dist.get_backend() != "gloo":
            return
        low_precision = (
            mp_policy.param_dtype in (torch.bfloat16, torch.float16)
            and mp_policy.reduce_dtype == torch.float32
        )
        use_p2p_collectives(module, wire_dtype=mp_policy.param_dtype if low_precision else None)

    def model_kernels(self, compute_dtype: torch.dtype = torch.bfloat16) -> Kernels:
        return cpu_kernels(compute_dtype)

    def cpu_offload_policy(self) -> CPUOffloadPolicy:
        """Pinned memory needs an accelerator; on a CPU device the "offload" keeps the shards where they
        are, but runs FSDP's offload path (host gradients, host optimizer step) all the same."""
        return CPUOffloadPolicy(pin_memory=False)
