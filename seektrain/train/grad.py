"""Global gradient norm and clipping over every shard of every parallel dimension."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, extra_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip to ``max_norm`` (0: only measure) and return the global L2 norm.

    DTensor gradients (FSDP, TP, EP) give a norm that already covers their mesh; gradients on
    different meshes (expert weights under EP live on their own) are reduced separately and their
    squares summed. ``extra_group`` adds ranks that hold *different* parameters (pipeline stages).
    """
    with_grad = [p for p in params if p.grad is not None]
    by_mesh: dict = {}  # parameters grouped by the mesh of their gradient (None: plain tensors)
    for p in with_grad:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = _on_mesh_device(norm).full_tensor()
        squares.append(norm.float().pow(2))
    device = squares[0].device if squares else None
    squared = torch.stack([s.to(device) for s in squares]).sum() if squares else torch.zeros(())
    if extra_group is not None and dist.get_world_size(extra_group) > 1:
        dist.all_reduce(squared, group=extra_group)
    norm = squared.sqrt()  # clip_grads_with_norm_ moves the scale to each gradient's device itself
    if max_norm > 0:
        # clip_grads_with_norm_ takes the parameters and scales their .grad (given gradients, whose own
        # .grad is None, it silently scaled nothing: clipping was off until this was found)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def _on_mesh_device(norm: DTensor) -> DTensor:
    """The partial norm of CPU-offloaded gradients (``parallel.cpu_offload``) lives in host memory while its
    mesh's collectives (NCCL) need device tensors: move the one scalar to the mesh's device type first."""
    local = norm.to_local()
    device_type = norm.device_mesh.device_type
    if local.device.type == device_type:
        return norm
    target = (
        torch.device(device_type, torch.accelerator.current_device_index()) if device_type != "cpu" else "cpu"
    )
    return DTensor.from_local(local.to(target), norm.device_mesh, norm.placements, run_check=False)
