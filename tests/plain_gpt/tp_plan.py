"""The plain GPT's tensor-parallel plan: its blocks call attention and the MLP with one input (no RoPE
tables or document mask), so their containers all-gather that one input; every weight's style comes
from its shape description through seektrain's generic ``weight_styles``."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput
from torch.distributed.tensor.parallel.style import ParallelStyle

from seektrain.parallel.tensor_parallel import weight_styles


def gpt_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for name in model.layers:
        for part in ("self_attn", "mlp"):
            plan[f"layers.{name}.{part}"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    plan.update(weight_styles(model, sp))
    return plan
