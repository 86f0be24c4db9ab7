"""The platform policy's interface, its generic (do-nothing) form, and the choice by device.

The trainer asks the policy at five points instead of testing the device itself: once per process
before any matmul, after every optimizer step, after sharding each model part with FSDP, for the
model's kernels, and whether host buffers that feed the device are pinned. So the generic path (CUDA)
never touches, or imports, what only the CPU needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from seektrain.models.flex_attention import document_block_mask, flex_causal_attention
from seektrain.models.kernels import Kernels

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy


class PlatformPolicy:
    """The generic policy: torch's defaults everywhere, plain model kernels."""

    def prepare_process(self, deterministic: bool, keep_freed_memory: bool) -> None:
        """Process-wide settings; call once, before any matmul. ``deterministic``: ``train.deterministic``;
        ``keep_freed_memory``: ``cpu.keep_freed_memory`` (only the CPU policy reads it)."""

    def end_of_step(self) -> None:
        """Call after every optimizer step."""

    def configure_fsdp(self, module: nn.Module, mp_policy: MixedPrecisionPolicy) -> None:
        """Call once per model part, after every ``fully_shard`` on it (``mp_policy``: the one it used)."""

    def model_kernels(self, compute_dtype: torch.dtype = torch.bfloat16) -> Kernels:
        """The kernels to build the training model with (``build_model(..., kernels=...)``) when it
        computes in ``compute_dtype`` (``RunPlan.compute_dtype``): the plain ones, with the experts'
        grouped GEMM where CUDA has one (bf16, dimensions multiples of 8, SM 9.0+; torch 2.11-2.13),
        else the batched matmul. Packed rows attend through FlexAttention block masks
        (``models/flex_attention.py``, loaded at their first use)."""
        hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
        return Kernels(
            grouped_mm_dtypes=(torch.bfloat16,) if hopper else (),
            grouped_mm_dim_multiple=8,
            attention=flex_causal_attention,
            document_mask=document_block_mask,
        )

    def pin_host_memory(self) -> bool:
        """Whether host copies that travel to or from the device (prefetched batches, checkpoint staging)
        go to pinned (page-locked) memory: only then do copies with ``non_blocking=True`` run
        asynchronously and at full bus speed. Pinning needs an accelerator."""
        return torch.accelerator.is_available()

    def cpu_offload_policy(self) -> CPUOffloadPolicy:
        """FSDP2's offload policy for ``parallel.cpu_offload``: pinned host memory, so the copies to and
        from the device overlap with compute."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        return CPUOffloadPolicy(pin_memory=True)


def policy_for(device: torch.device | str) -> PlatformPolicy:
    """The policy of ``device``: the CPU policy for a CPU device, the generic one otherwise."""
    if torch.device(device).type == "cpu":
        from seektrain.platform.cpu_policy import CpuPolicy  # only a CPU process loads CPU-only code

        return CpuPolicy()
    return PlatformPolicy()
