"""Data parallelism applied to a plain model over mesh views: DDP, FSDP2 (ZeRO-3), HSDP.

FSDP shards every decoder layer (and MTP module) as its own unit, then the root (embedding, final
norm, head). ``reshard_after_forward=False`` keeps parameters gathered between forward and backward,
trading memory for one all-gather less per layer (ZeRO-2-like). An ``offload`` policy
(``parallel.cpu_offload``) keeps the shards, their gradients and so the optimizer state in host memory
(ZeRO-Offload/Infinity's idea, done by FSDP2 itself). The platform policy may then change how
FSDP communicates (``PlatformPolicy.configure_fsdp``: on CPU, point-to-point collectives over gloo).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from seektrain.config.dtypes import DTYPES as _DTYPES
from seektrain.models.registry import model_blocks


def fsdp_mixed_precision(dtype_name: str, reduce_dtype_name: str = "fp32") -> MixedPrecisionPolicy:
    """Compute in the run's dtype over fp32 master weights; reduce gradients in fp32 (exact sums) or,
    with ``precision.reduce_dtype = "bf16"``, in bf16 (half the bytes, as DeepSpeed does by default)."""
    reduce = torch.float32 if dtype_name == "fp32" else _DTYPES[reduce_dtype_name]
    return MixedPrecisionPolicy(param_dtype=_DTYPES[dtype_name], reduce_dtype=reduce)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    offload: OffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` over ``dp_mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP); ``offload``: a
    ``CPUOffloadPolicy`` to keep the shards in host memory (None: on the device)."""
    offload = offload or OffloadPolicy()
    blocks = model_blocks(model)
    for i, block in enumerate(blocks):
        # The last block is resharded at once: the root's backward runs right after it anyway.
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
        )
    fully_shard(
        model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward
    )
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicate ``model`` over ``dp_mesh``; gradients are averaged in buckets during backward."""
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    return DistributedDataParallel(
        model, process_group=dp_mesh.get_group(), device_ids=device_ids, broadcast_buffers=False
    )
