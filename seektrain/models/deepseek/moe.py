"""DeepSeekMoE: a router, routed experts run as one grouped GEMM, and always-on shared experts.

Tokens are sorted by expert so every expert sees one contiguous slice; the experts then run as a single
grouped matrix multiply over fused weights ``gate_up_proj [E, 2F, D]`` and ``down_proj [E, D, F]``.
Where the platform has no grouped GEMM for the dtype, a padded batched matmul computes the same thing.
No per-expert Python loop slices the fused weights (its backward would allocate a full-size gradient
per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seektrain.models.autograd_phase import in_backward
from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.moe_rows import PermuteRows, run_padded_groups
from seektrain.models.kernels import Kernels
from seektrain.models.layers import SwiGLU
from seektrain.models.lora import ExpertAdapters, expert_adapters

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def count_slots(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of ``idx``'s token slots chose each expert, ``[n_experts]`` int64. A scatter-add rather
    than ``torch.bincount``, which on CUDA reads the smallest and largest index on the host to check
    and size its output: a device sync in every MoE layer's forward."""
    flat = idx.flatten()
    return torch.zeros(n_experts, dtype=torch.long, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _AttachAuxLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward feeds ``scale`` as the gradient of ``aux_loss``.

    The balance loss thus reaches the router without travelling through the model's outputs, which
    keeps pipeline stages and activation checkpointing oblivious to it.
    """

    @staticmethod
    def forward(ctx, x, aux_loss, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class Router(nn.Module):
    """Top-k routing. V2: softmax scores, greedy or group-limited (group score = max). V3: sigmoid scores,
    a correction bias that affects only *which* experts are chosen, group score = sum of the top 2."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = F.linear(x_ND.float(), self.weight.float())
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = (
            scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        )
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
                fill = float("-inf")
            else:
                group_scores = grouped.max(dim=-1).values
                fill = 0.0
            keep = torch.zeros_like(group_scores).scatter_(
                1, group_scores.topk(cfg.topk_group, dim=-1).indices, 1.0
            )
            keep = keep.bool().unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
            choice = choice.masked_fill(~keep, fill)
        idx_NK = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights_NK = scores.gather(1, idx_NK)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            weights_NK = weights_NK / (weights_NK.sum(-1, keepdim=True) + 1e-20)
        return weights_NK * cfg.routed_scaling_factor, idx_NK, scores


PLAIN_KERNELS = Kernels()  # the default of grouped_swiglu: plain kernels (a frozen dataclass, shared)


def grouped_swiglu(
    x_ND: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    kernels: Kernels = PLAIN_KERNELS,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """E SwiGLU experts (``gate_up [E, 2F, D]``, ``down [E, D, F]``) over token slots already sorted by
    expert, ``counts_E`` slots each: one grouped GEMM per projection, or a padded batched matmul where
    ``kernels`` has no grouped GEMM for the dtype and shapes (or no slots at all, which the grouped GEMM's
    backward rejects on CPU). Shared by the plain and the expert-parallel experts.
    ``kernels.expert_row_multiple`` > 1 pads each expert's rows with zero rows to a multiple of it before
    the grouped GEMM (the result is the same).

    Under autocast both paths compute in the autocast dtype (autocast does not cover the grouped GEMM
    but does cover ``bmm``): the result's dtype must not depend on how many tokens a rank received,
    or expert parallelism's return all-to-all would mix dtypes across ranks.

    ``adapters``: the experts' LoRA adapters (``models/lora.py``), added to each projection's output by
    two more products per projection over the same groups (the same grouped GEMM or batched matmul)."""
    if torch.is_autocast_enabled(x_ND.device.type):
        dtype = torch.get_autocast_dtype(x_ND.device.type)
        x_ND, gate_up_proj, down_proj = x_ND.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)
        adapters = adapters.cast(dtype) if adapters is not None else None
    dims = (*gate_up_proj.shape[1:], *((adapters.rank,) if adapters is not None else ()))
    covered = _grouped_mm is not None and kernels.grouped_mm_covers(x_ND, *dims)
    if adapters is not None:  # the grouped GEMM takes rows whose stride is a multiple of 16 bytes only
        covered = covered and adapters.rank * x_ND.element_size() % 16 == 0
    if x_ND.shape[0] and covered:
        grouped_mm = _grouped_mm
        assert grouped_mm is not None  # covered says so

        def swiglu(x, counts):
            offs = counts.cumsum(0).to(torch.int32)

            def mm(a, w):  # a @ w^T per expert group
                return _ContiguousGrad.apply(grouped_mm(a, w.transpose(-2, -1), offs=offs))

            return _swiglu_with(mm, x, gate_up_proj, down_proj, adapters)

        if kernels.expert_row_multiple > 1:
            return run_padded_groups(swiglu, x_ND, counts_E, kernels.expert_row_multiple)
        return swiglu(x_ND, counts_E)
    return _padded_bmm_swiglu(x_ND, counts_E, gate_up_proj, down_proj, adapters)


def _swiglu_with(mm, x, gate_up_proj, down_proj, adapters: ExpertAdapters | None) -> torch.Tensor:
    """The experts' SwiGLU with every product ``mm(x, w)`` (``x @ w^T`` per expert), adapters included."""
    gate_up = mm(x, gate_up_proj)
    if adapters is not None:
        gate_up = gate_up + adapters.delta("gate_up", x, mm)
    gate, up = gate_up.chunk(2, -1)
    h = F.silu(gate) * up
    out = mm(h, down_proj)
    if adapters is not None:
        out = out + adapters.delta("down", h, mm)
    return out


def _padded_bmm_swiglu(x_ND, counts_E, gate_up_proj, down_proj, adapters=None) -> torch.Tensor:
    n_experts = counts_E.shape[0]
    capacity = int(counts_E.max()) if x_ND.shape[0] else 0
    expert_of = torch.repeat_interleave(torch.arange(n_experts, device=x_ND.device), counts_E)
    starts = counts_E.cumsum(0) - counts_E
    slot = torch.arange(x_ND.shape[0], device=x_ND.device) - starts[expert_of]
    padded = x_ND.new_zeros(n_experts, capacity, x_ND.shape[-1])
    padded[expert_of, slot] = x_ND
    out = _swiglu_with(
        lambda a, w: torch.bmm(a, w.transpose(1, 2)), padded, gate_up_proj, down_proj, adapters
    )
    return out[expert_of, slot]


class GroupedExperts(nn.Module):
    """E SwiGLU experts and the routed half of an MoE block: every token's chosen experts, weighted.

    ``forward(x_ND, weights_NK, idx_NK, counts_E)`` is the whole contract ``MoE`` relies on, so a
    parallel variant replaces this module (not ``MoE``): expert parallelism overrides ``run_sorted`` to
    exchange the token slots around ``grouped_swiglu``; tensor parallelism runs only its own experts."""

    def __init__(self, n_experts: int, dim: int, hidden: int, kernels: Kernels | None = None):
        super().__init__()
        self.kernels = kernels or Kernels()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(
        self, x_ND: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        """Sum over every token's chosen experts of weight * expert(token), [N, D]."""
        N, K = idx_NK.shape
        order = idx_NK.flatten().argsort(stable=True)  # slot (token * K + k) of each expert-sorted row
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        x_slots = x_ND.unsqueeze(1).expand(N, K, x_ND.shape[1]).reshape(N * K, -1)
        y = self.run_sorted(PermuteRows.apply(x_slots, order, inverse), counts_E)
        y_NKD = PermuteRows.apply(y, inverse, order).view(N, K, -1)
        return (y_NKD * weights_NK.unsqueeze(-1).to(y.dtype)).sum(1).to(x_ND.dtype)

    def run_sorted(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts over token slots sorted by expert, ``counts_E`` slots each."""
        return grouped_swiglu(
            x_ND, counts_E, self.gate_up_proj, self.down_proj, self.kernels, expert_adapters(self)
        )


class MoE(nn.Module):
    """Routed experts + shared experts. Records per-expert token counts for load balancing.

    Training-time knobs are plain attributes set by the trainer: ``aux_loss_alpha`` (sequence-wise
    balance loss weight; 0 disables it) and ``aux_loss_scale`` (gradient scale, e.g. 1/accumulation).
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.gate = Router(cfg)
        self.experts = GroupedExperts(
            cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, kernels
        )
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )
        self.aux_loss_alpha = 0.0
        self.aux_loss_scale = 1.0
        self.expert_counts: list[torch.Tensor] = []  # tokens per expert, one entry per forward call

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        weights_NK, idx_NK, scores_NE = self.gate(x_ND)
        counts_E = count_slots(idx_NK, self.n_experts)
        out = self.experts(x_ND, weights_NK, idx_NK, counts_E).view(B, T, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_BTD)
        if self.training and not in_backward():  # recomputation in backward must not count twice
            self._record(counts_E)
        if self.training and self.aux_loss_alpha > 0:
            aux = self._sequence_aux_loss(scores_NE.view(B, T, -1), idx_NK.view(B, T, -1))
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out

    @torch.compiler.disable  # traced, the growing list's length is a guard: a recompile per micro-batch
    def _record(self, counts_E: torch.Tensor) -> None:
        self.expert_counts.append(counts_E.detach().float())

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Tokens routed to each expert since the trainer last cleared ``expert_counts``."""
        if not self.expert_counts:
            return torch.zeros(self.n_experts, device=self.gate.weight.device)
        return torch.stack(self.expert_counts).sum(0)

    def _sequence_aux_loss(self, scores_BTE: torch.Tensor, idx_BTK: torch.Tensor) -> torch.Tensor:
        """alpha * sum_i f_i * P_i per sequence (DeepSeek-V3 eq. 17-20), averaged over sequences."""
        B, T, E = scores_BTE.shape
        probs = scores_BTE / (scores_BTE.sum(-1, keepdim=True) + 1e-20)
        hits = torch.zeros(B, E, device=scores_BTE.device).scatter_add_(
            1, idx_BTK.reshape(B, -1), torch.ones(B, T * self.top_k, device=scores_BTE.device)
        )
        f = hits * (E / (self.top_k * T))
        p = probs.mean(dim=1)
        return self.aux_loss_alpha * (f * p).sum(-1).mean()
