"""Which part of each full tensor a rank holds: the local tensors of a (possibly sharded) module's state
dict with the box (a ``[start, stop)`` range per dimension) of the full tensor each one is.

A plain tensor is the whole of itself. A DTensor's local tensor is the box that torch computes for DCP's
own checkpoints (``compute_local_shape_and_global_offset``, which knows FSDP2's strided shards over a
tensor-parallel dimension), so a loader that fills these boxes fills exactly what DCP would have.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from seektrain.models.hf_slice_reader import LocalShard, state_tensors, whole_shard


def local_shard(name: str, tensor: torch.Tensor) -> LocalShard:
    if not isinstance(tensor, DTensor):
        return whole_shard(name, tensor)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = tuple(tensor.shape)
    local = tensor.to_local().detach()
    shape, offset = compute_local_shape_and_global_offset(full, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(
            f"{name}: local tensor {tuple(local.shape)} is not the box {tuple(shape)} its placements "
            f"{tensor.placements} give; this layout cannot be loaded slice by slice"
        )
    return LocalShard(name, local, tuple((o, o + s) for o, s in zip(offset, shape)), full)


def local_shards(module: nn.Module) -> list[LocalShard]:
    """This rank's shard of every tensor of ``module`` (``state_tensors``: each tensor once)."""
    return [local_shard(name, tensor) for name, tensor in state_tensors(module)]
