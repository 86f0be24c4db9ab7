"""MoE load balancing across ranks: DeepSeek-V3's auxiliary-loss-free bias update, the sequence-wise
auxiliary loss knobs, and the expert-load statistics we log."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seektrain.models.moe import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def configure_aux_loss(model: nn.Module, alpha: float, grad_scale: float) -> None:
    for moe in moe_layers(model):
        moe.aux_loss_alpha, moe.aux_loss_scale = alpha, grad_scale


def collect_expert_load(model: nn.Module, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Per-layer tokens per expert since the last call, summed over the data-parallel ``group``; resets."""
    layers = moe_layers(model)
    if not layers:
        return []
    counts = torch.stack([m.tokens_per_expert for m in layers])  # on the device: NCCL reduces it
    for m in layers:
        m.expert_counts.clear()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return list(counts)


@torch.no_grad()
def update_balance_bias(
    model: nn.Module, loads: list[torch.Tensor], speed: float, apply: torch.Tensor | None = None
) -> None:
    """bias_i += speed * sign(mean load - load_i): overloaded experts get chosen less next step.
    Every rank applies the same update from the same all-reduced counts, so biases stay identical.
    ``apply``: a bool tensor on the device; where False (a skipped step) the biases stay as they are,
    decided on the device rather than by reading the flag on the host."""
    if speed <= 0:
        return
    for moe, load in zip(moe_layers(model), loads):
        bias = moe.gate.e_score_correction_bias
        if bias is not None:
            delta = speed * torch.sign(load.mean() - load).to(bias.device, bias.dtype)
            bias.add_(delta if apply is None else torch.where(apply.to(bias.device), delta, 0.0))


def expert_imbalance(loads: list[torch.Tensor]) -> torch.Tensor:
    """Worst layer's max/mean tokens per expert (1.0 = perfectly balanced; layers that saw no token are
    left out), as a 0-dim tensor on the loads' device: read on the host only when it is logged. One
    reduction over all layers; the counts are whole numbers, so while a layer routes fewer than 2**24
    slots a step its float32 sum is exact in any order and each ratio equals a per-layer computation's."""
    stacked = torch.stack(loads)  # [layers, experts]
    ratios = stacked.amax(1) / stacked.mean(1)
    seen = stacked.sum(1) > 0
    return torch.where(seen.any(), torch.where(seen, ratios, 0.0).amax(), 1.0)
