"""Global gradient norm and clipping over every shard of every parallel dimension."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                   extra_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip to ``max_norm`` (0: only measure) and return the global L2 norm.

    DTensor gradients (FSDP, TP) give a norm that already covers their mesh; ``extra_group`` adds ranks
    that hold *different* parameters (pipeline stages), whose squared norms are summed.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if extra_group is not None and dist.get_world_size(extra_group) > 1:
        squared = norm.pow(2)
        dist.all_reduce(squared, group=extra_group)
        norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)
    return norm
