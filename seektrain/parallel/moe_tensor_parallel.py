"""Tensor parallelism for a DeepSeekMoE block.

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
their output left as a partial sum to add to the routed one.

With expert parallelism over the tp ranks (``parallel.ep = tp × k``, torchtitan's "ETP=1"), the routed
experts are not split over tp by this module: they are already ``ExpertParallelExperts`` over an ep group
made of whole tp groups. Every tp rank still routes the same all-gathered sequence (same choices, counts,
bias and balance loss), then dispatches only its own 1/tp of the tokens through the ep all-to-all
(``TokenSplitMoE``); the zero rows of the other tokens make the output the same kind of partial sum.

Letters: N tokens, K experts per token, E experts, L experts on this rank, D hidden size.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

from seektrain.models.moe import MoE, grouped_swiglu
from seektrain.parallel.expert_parallel import ExpertParallelExperts
from seektrain.parallel.tensor_parallel import LocalParams, SumGrad


class TensorParallelMoE(MoE):
    """``MoE`` whose routed part runs this tp rank's ``E / tp`` experts and returns a partial sum.
    (Installed by swapping the class of an existing ``MoE``: names and submodules are unchanged.)"""

    tp_mesh: DeviceMesh

    def routed_experts(self, x_ND: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor,
                       counts_E: torch.Tensor) -> torch.Tensor:
        group = self.tp_mesh.get_group()
        w1, w2 = self.experts.gate_up_proj.to_local(), self.experts.down_proj.to_local()
        L = w1.shape[0]
        e0 = self.tp_mesh.get_local_rank() * L
        # The output is a partial sum over tp ranks, so the gradients reaching the router's weights and
        # the routed tokens are partial too: sum them (the router itself sees full gradients).
        weights_NK = SumGrad.apply(weights_NK, group)
        x_ND = SumGrad.apply(x_ND, group)
        order = idx_NK.flatten().argsort(stable=True)
        lo = int(counts_E[:e0].sum())
        order = order[lo:lo + int(counts_E[e0:e0 + L].sum())]  # slots routed to my experts
        token = order // self.top_k
        y = grouped_swiglu(x_ND[token], counts_E[e0:e0 + L], w1, w2)
        y = y * weights_NK.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x_ND).index_add_(0, token, y.to(x_ND.dtype))


class TokenSplitMoE(MoE):
    """``MoE`` under TP whose routed experts are expert-parallel over ranks that include every tp rank:
    each tp rank sends only tokens ``[N·t/tp, N·(t+1)/tp)`` of the routed sequence to the ep all-to-all,
    so a token's experts run once in the whole tp group, and returns a partial sum (zero elsewhere).
    (Installed by swapping the class of an existing ``MoE``: names and submodules are unchanged.)"""

    tp_mesh: DeviceMesh

    def routed_experts(self, x_ND: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor,
                       counts_E: torch.Tensor) -> torch.Tensor:
        group, tp, t = self.tp_mesh.get_group(), self.tp_mesh.size(), self.tp_mesh.get_local_rank()
        # As in TensorParallelMoE: the output is a partial sum over tp ranks, so are these gradients.
        weights_NK = SumGrad.apply(weights_NK, group)
        x_ND = SumGrad.apply(x_ND, group)
        N = x_ND.shape[0]
        lo, hi = N * t // tp, N * (t + 1) // tp
        mine_idx = idx_NK[lo:hi]
        mine_counts = torch.bincount(mine_idx.flatten(), minlength=self.n_experts)
        y = MoE.routed_experts(self, x_ND[lo:hi], weights_NK[lo:hi], mine_idx, mine_counts)
        return torch.nn.functional.pad(y, (0, 0, lo, N - hi))


def moe_plan(moe: MoE, prefix: str, seq: Placement, sp: bool, mesh: DeviceMesh) -> dict:
    """The parallelize_module plan of one MoE block; also makes it a ``TensorParallelMoE`` (or a
    ``TokenSplitMoE`` when its experts are already expert-parallel)."""
    expert_parallel = isinstance(moe.experts, ExpertParallelExperts)
    moe.__class__ = TokenSplitMoE if expert_parallel else TensorParallelMoE
    moe.tp_mesh = mesh
    plan = {
        prefix: PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Partial(),), desired_output_layouts=(seq,), use_local_output=not sp),
        f"{prefix}.gate": LocalParams(),
    }
    if not expert_parallel:
        plan[f"{prefix}.experts"] = LocalParams(Shard(0))  # TensorParallelMoE reads the local shards itself
    if moe.shared_experts is not None:
        shared = f"{prefix}.shared_experts"
        plan.update({f"{shared}.gate_proj": ColwiseParallel(), f"{shared}.up_proj": ColwiseParallel(),
                     f"{shared}.down_proj": RowwiseParallel(output_layouts=Partial())})
    return plan

