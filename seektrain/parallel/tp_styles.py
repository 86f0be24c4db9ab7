"""Building blocks shared by tensor and expert parallelism: a gradient sum over a group, a
``ParallelStyle`` that keeps DTensor parameters but computes on their local shards, and torch's column-
and row-wise styles extended to a linear's LoRA adapters.

They live apart from the plans that use them so tensor_parallel.py, moe_tensor_parallel.py and
expert_parallel.py can each import them without importing one another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
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


def _place_adapters(module: nn.Module, mesh: DeviceMesh, a: Placement, b: Placement) -> None:
    """A linear's LoRA adapters (``lora_A [r, in]``, ``lora_B [out, r]``; models/lora.py), if it has them,
    as DTensors placed ``a`` and ``b``, keeping ``requires_grad``."""
    for name, placement in (("lora_A", a), ("lora_B", b)):
        param = getattr(module, name, None)
        if param is not None:
            dt = distribute_tensor(param.data, mesh, [placement])
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class AdaptedColwise(ColwiseParallel):
    """``ColwiseParallel`` (output features sharded) whose adapters follow: ``B @ A @ x`` must give this
    rank's output features, so A is replicated (it reads the whole, gathered input) and B sharded by
    rows like the weight. (torch's own style would shard A by its rank rows: a wrong product.)"""

    def _partition_linear_fn(self, name, module, device_mesh):
        for p_name in ("weight", "bias"):
            param = getattr(module, p_name, None)
            if param is not None:
                dt = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
                module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))
        _place_adapters(module, device_mesh, Replicate(), Shard(0))


class AdaptedRowwise(RowwiseParallel):
    """``RowwiseParallel`` (input features sharded, partial output) whose adapters follow: A sharded by
    its input columns like the weight, so ``A @ x`` is a partial sum over ranks; B replicated keeps
    ``B @ A @ x`` partial, reduced with the base output."""

    def _partition_linear_fn(self, name, module, device_mesh):
        super()._partition_linear_fn(name, module, device_mesh)
        _place_adapters(module, device_mesh, Shard(1), Replicate())
