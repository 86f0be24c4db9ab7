"""Expert parallelism (EP) for DeepSeekMoE, applied from outside to a plain ``Transformer``.

The routed experts of every MoE layer are split over ``ep`` ranks borrowed from the data-parallel shard
ranks and, under tensor parallelism, from every tp rank as well (``ep = tp × k``; each tp rank then
dispatches its own 1/tp of the tokens, see ``ExpertParallelExperts.forward``). The meshes come from the
run plan (seektrain/parallel/mesh.py), which has also checked that ``ep`` fits the model and layout. Each rank keeps
``E / ep`` experts as a DTensor ``Shard(0)`` of the full ``[E, ...]`` weights (so state-dict names, DCP
checkpoints and the layout-independent init are unchanged). Each rank routes its own tokens as before;
the experts module then

1. exchanges how many token slots every rank sends to every expert (all-to-all of ``counts_E``),
2. sends every slot to the rank that owns its expert (differentiable all-to-all),
3. regroups the received slots by local expert and runs them as one grouped GEMM (``grouped_swiglu``),
4. undoes the regrouping and sends the results back (the inverse all-to-all).

Letters: N token slots on this rank (tokens × top-k, sorted by expert), E experts in all, L experts
on this rank (E / R), R ranks of the ep group, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from seektrain.models import GroupedExperts, MoE, count_slots, grouped_swiglu
from seektrain.models.lora import expert_adapters
from seektrain.parallel.tp_styles import SumGrad

_all_to_all_calls = 0  # all-to-alls this process has issued (forward, backward, counts): the run record


def all_to_all_calls() -> int:
    """How many expert-parallel all-to-alls this process has issued so far. A plain Python counter,
    bumped where each one is issued (no device sync): the run monitor's per-step difference goes into
    ``summary.json`` (``layout_ran``), so a run whose experts never left the rank shows 0."""
    return _all_to_all_calls


def shard_expert_weights(module: nn.Module, experts: GroupedExperts, mesh: DeviceMesh) -> None:
    """Register on ``module`` this rank's ``E / R`` experts of ``experts`` as DTensor ``Shard(0)`` over the
    1-D ``mesh`` (full ``[E, ...]`` shapes, so names, checkpoints and the layout-independent init stay as
    in the plain model). Meta tensors stay meta; real values are kept. Every parameter of ``experts`` is
    ``[E, ...]``: the LoRA adapters (``models/lora.py``) go with their experts, and their settings too."""
    ranks, rank = mesh.size(), mesh.get_local_rank()
    for name, full in list(experts.named_parameters(recurse=False)):
        local = full.detach().chunk(ranks, dim=0)[rank].clone()
        dt = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        module.register_parameter(name, nn.Parameter(dt, requires_grad=full.requires_grad))
    for setting in ("lora_scaling", "lora_dropout"):
        if hasattr(experts, setting):
            setattr(module, setting, getattr(experts, setting))


def _all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of ``x_ND`` exchanged over ``group`` with uneven splits, as a functional collective: it returns a
    new tensor instead of filling a buffer in place, so a selective activation checkpoint keeps the result
    rather than communicating again when it recomputes the layer (seektrain/parallel/activation_checkpoint.py)."""
    global _all_to_all_calls
    _all_to_all_calls += 1
    out = torch.ops._c10d_functional.all_to_all_single(
        x_ND.contiguous(), out_splits, in_splits, group.group_name
    )
    return torch.ops._c10d_functional.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """``_all_to_all`` along dim 0 with uneven splits; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x_ND, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelExperts(GroupedExperts):
    """This rank's ``E / R`` experts, with ``GroupedExperts``' contract over all E experts.

    ``tp_mesh``: when the ep group is made of whole tensor-parallel groups (``ep = tp × k``), every tp rank
    has routed the same all-gathered sequence; each then dispatches only tokens ``[N·t/tp, N·(t+1)/tp)``
    so a token's experts run once in the tp group, and returns a partial sum (zero elsewhere), which the
    MoE block's tensor-parallel output layout reduce-scatters."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None):
        nn.Module.__init__(self)
        self.ep_mesh, self.tp_mesh = ep_mesh, tp_mesh
        self.tp = tp_mesh.size() if tp_mesh is not None else 1
        self.kernels = experts.kernels
        shard_expert_weights(self, experts, ep_mesh)

    def forward(
        self, x_ND: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        if self.tp == 1:
            return super().forward(x_ND, weights_NK, idx_NK, counts_E)
        assert self.tp_mesh is not None  # tp > 1: built with the tp mesh
        group, t = self.tp_mesh.get_group(), self.tp_mesh.get_local_rank()
        # The output is a partial sum over tp ranks, so the gradients reaching the router's weights and
        # the routed tokens are partial too: sum them (the router itself sees full gradients).
        weights_NK = SumGrad.apply(weights_NK, group)
        x_ND = SumGrad.apply(x_ND, group)
        N = x_ND.shape[0]
        lo, hi = N * t // self.tp, N * (t + 1) // self.tp
        mine_idx = idx_NK[lo:hi]
        mine_counts = count_slots(mine_idx, counts_E.numel())
        y = super().forward(x_ND[lo:hi], weights_NK[lo:hi], mine_idx, mine_counts)
        return torch.nn.functional.pad(y, (0, 0, lo, N - hi))

    def run_sorted(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        group, R = self.ep_mesh.get_group(), self.ep_mesh.size()
        E = counts_E.numel()
        L = E // R
        # 1. recv_RL[r, l]: slots rank r sends to my l-th expert.
        recv_RL = _all_to_all(counts_E, [L] * R, [L] * R, group).view(R, L)
        # The one host read of the step outside the flush steps: an all-to-all with uneven splits needs
        # their sizes on the host, to size its output and tell each peer how much comes. A sync-free
        # exchange would have to send a fixed capacity per peer: drop tokens (a different model) or pad
        # to the worst case (R times the memory). Both lists are read at once: one wait, not two.
        # Slots are sorted by expert, hence by owner.
        send_splits, recv_splits = torch.stack([counts_E.view(R, L).sum(1), recv_RL.sum(1)]).tolist()
        # 2. The slots themselves, ordered (source rank, local expert) on arrival.
        x_recv = _AllToAll.apply(x_ND, recv_splits, send_splits, group)
        # 3. Regroup by local expert (stable: within an expert, source rank 0's slots first, as one
        #    process holding every rank's batch in rank order would see them).
        local_of_slot = torch.repeat_interleave(
            torch.arange(E, device=x_ND.device) % L, recv_RL.flatten(), output_size=sum(recv_splits)
        )  # known: no second read
        order = local_of_slot.argsort(stable=True)
        # Gradient scale. The single-process gradient is that of the mean loss over every data-parallel
        # rank's tokens, (1/dp) Σ_r ∂L_r/∂w (equal token counts per rank). Each rank backpropagates its
        # own L_r; the all-to-all backward brings every ep-rank's ∂L_r/∂y for my experts here, so the
        # local weight gradient is already the SUM over the B = R / tp batches of my ep group (tp peers
        # hold disjoint tokens of one batch: their parts add up to that batch's gradient). FSDP then
        # AVERAGES it over the dp/B ranks of the expert-FSDP mesh (the other replicas of these experts),
        # giving (B/dp) Σ_r ∂L_r/∂w: dividing by B here yields exactly (1/dp) Σ_r ∂L_r/∂w, as FSDP's
        # average over all dp ranks does for every non-expert parameter. (Only the weights' gradient is
        # scaled, not the one flowing back to the tokens.)
        # The adapters are weights of my experts like any other.
        scale = self.tp / R

        def local(w: torch.Tensor) -> torch.Tensor:
            return _ScaleGrad.apply(w.to_local() if isinstance(w, DTensor) else w, scale)

        w1, w2 = local(self.gate_up_proj), local(self.down_proj)
        y_local = grouped_swiglu(
            x_recv[order], recv_RL.sum(0), w1, w2, self.kernels, expert_adapters(self, local)
        )
        # 4. Back to arrival order, then back to the senders.
        y_recv = y_local[order.argsort()]
        return _AllToAll.apply(y_recv, send_splits, recv_splits, group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
    """Split the routed experts of every MoE layer (MTP modules included) over ``ep_mesh``, in place.
    ``tp_mesh``: the ep group includes every rank of its tensor-parallel groups; apply tensor parallelism
    *after* this. Call on the meta-device model before FSDP, ``to_empty`` and ``init_weights``."""
    if ep_mesh.size() == 1:
        return
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        moe.experts = ExpertParallelExperts(moe.experts, ep_mesh, tp_mesh)


def shard_experts(
    model: nn.Module,
    efsdp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    offload: OffloadPolicy | None = None,
) -> None:
    """FSDP for the expert-parallel experts over the expert-FSDP mesh (even of size 1: FSDP then owns
    them, so the per-layer ``fully_shard`` over ``dp_shard`` that follows leaves them alone). Call after
    ``apply_expert_parallel`` and before ``apply_fsdp``. FSDP's default average over ``efsdp`` is right:
    the remaining 1/ep is applied in the forward (see ``ExpertParallelExperts``). ``offload``: as in
    ``apply_fsdp`` (``parallel.cpu_offload``)."""
    offload = offload or OffloadPolicy()
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            fully_shard(
                module,
                mesh=efsdp_mesh,
                mp_policy=mp_policy,
                offload_policy=offload,
                reshard_after_forward=reshard_after_forward,
            )
