"""Building blocks shared by tensor and expert parallelism: a gradient sum over a group, and a
``ParallelStyle`` that keeps DTensor parameters but computes on their local shards.

They live apart from the plans that use them so tensor_parallel.py, moe_tensor_parallel.py and
expert_parallel.py can each import them without importing one another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle


class SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (from column ``start`` of the last dim
    on; earlier columns pass unchanged). For a replicated tensor whose consumers on each rank see only
    their own heads or experts and so produce partial gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, start: int = 0) -> torch.Tensor:
        ctx.group, ctx.start = group, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous() if ctx.start == 0 else grad.clone()
        part = grad if ctx.start == 0 else grad[..., ctx.start :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        if ctx.start:
            grad[..., ctx.start :] = part
        return grad, None, None


class LocalParams(ParallelStyle):
    """Parameters become DTensors (``placement``, default ``Replicate``), but the module computes on plain
    local tensors: forward hooks swap its parameters for their local shards for the duration of each call
    (``to_local`` is differentiable, so gradients reach the DTensors). With ``Replicate``, correct only when
    inputs and output gradients are identical on every tp rank (then so are the parameter gradients)."""

    def __init__(self, placement: Placement | None = None):
        super().__init__()
        self.placement = placement or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(param.data, device_mesh, [self.placement])
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        saved: list[dict] = []

        def to_local(mod, _args):
            saved.append(dict(mod._parameters))
            for key, value in saved[-1].items():
                if isinstance(value, DTensor):
                    mod._parameters[key] = value.to_local()

        def restore(mod, _args, _out):
            mod._parameters.update(saved.pop())

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        return module
