"""Tensor parallelism for a DeepSeekMoE block, as a ``ParallelStyle`` that replaces the block's experts.

Every tp rank routes the same, all-gathered sequence (so the router's choices, the per-expert token
counts and the balancing bias stay identical across tp ranks), then runs only its own routed experts;
the block's output is a partial sum that is reduce-scattered back to sequence shards (``Partial`` ->
``seq``).

Routed experts are split *by expert* (``Shard(0)`` of ``gate_up_proj [E, 2F, D]`` and
``down_proj [E, D, F]``), not by hidden feature F: the fused ``gate_up_proj`` stores all gate rows,
then all up rows, so an F-split needs each rank to hold two separate row blocks, a non-contiguous shard
(``_StridedShard``) that DCP cannot save. Expert-sharding keeps state-dict names, full-tensor values,
checkpoints and the layout-independent init unchanged; the price is that a rank's expert work follows
the routing balance. The router is replicated; shared experts are column/row-wise like a dense MLP,
their output left as a partial sum to add to the routed one (the styles the shape description,
``models/deepseek/shapes.py``, gives them; ``tensor_parallel.py`` applies them).

With expert parallelism over the tp ranks (``parallel.ep = tp × k``, torchtitan's "ETP=1"), the routed
experts are already ``ExpertParallelExperts`` built with the tp mesh, which dispatch only this tp rank's
share of the tokens (seektrain/parallel/expert_parallel.py); this style then leaves them alone.

Letters: N tokens, K experts per token, E experts, L experts on this rank, D hidden size.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor.parallel import PrepareModuleInputOutput
from torch.distributed.tensor.parallel.style import ParallelStyle

from seektrain.models import GroupedExperts, MoE, grouped_swiglu
from seektrain.models.lora import expert_adapters
from seektrain.parallel.expert_parallel import ExpertParallelExperts, shard_expert_weights
from seektrain.parallel.tp_styles import SumGrad


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight ``shard_expert_weights`` made a DTensor ``Shard(0)``."""
    return cast(DTensor, w).to_local()


class TensorParallelExperts(GroupedExperts):
    """This tp rank's ``E / tp`` experts (DTensor ``Shard(0)`` over the tp mesh, full-model names); with
    ``GroupedExperts``' contract, it returns the partial sum over its own experts only."""

    def __init__(self, experts: GroupedExperts, tp_mesh: DeviceMesh):
        nn.Module.__init__(self)
        self.tp_mesh, self.kernels = tp_mesh, experts.kernels
        shard_expert_weights(self, experts, tp_mesh)

    def forward(
        self, x_ND: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        group = self.tp_mesh.get_group()
        w1, w2 = _local(self.gate_up_proj), _local(self.down_proj)
        L = w1.shape[0]
        e0 = self.tp_mesh.get_local_rank() * L
        # The output is a partial sum over tp ranks, so the gradients reaching the router's weights and
        # the routed tokens are partial too: sum them (the router itself sees full gradients).
        weights_NK = SumGrad.apply(weights_NK, group)
        x_ND = SumGrad.apply(x_ND, group)
        top_k = idx_NK.shape[1]
        order = idx_NK.flatten().argsort(stable=True)
        # Where my experts' slots start and how many there are, read on the host (one wait for the device):
        # the slice's size depends on the routing. Avoiding the read would mean running every slot.
        lo, mine = torch.stack([counts_E[:e0].sum(), counts_E[e0 : e0 + L].sum()]).tolist()
        order = order[lo : lo + mine]  # slots routed to my experts
        token = order // top_k
        adapters = expert_adapters(self, _local)
        y = grouped_swiglu(x_ND[token], counts_E[e0 : e0 + L], w1, w2, self.kernels, adapters)
        y = y * weights_NK.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x_ND).index_add_(0, token, y.to(x_ND.dtype))


class MoETensorParallel(ParallelStyle):
    """The MoE block's input all-gathered from ``seq``, its output a partial sum reduce-scattered back to
    ``seq``; its routed experts replaced by ``TensorParallelExperts`` unless already expert-parallel."""

    def __init__(self, seq: Placement, sequence_parallel: bool):
        super().__init__()
        self.layouts = PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(seq,),
            use_local_output=not sequence_parallel,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoE):
            raise TypeError(f"MoETensorParallel applies to an MoE block, not {type(module).__name__}")
        if not isinstance(module.experts, ExpertParallelExperts):
            module.experts = TensorParallelExperts(module.experts, device_mesh)
        return self.layouts._apply(module, device_mesh)
