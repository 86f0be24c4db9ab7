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
def update_balance_bias(model: nn.Module, loads: list[torch.Tensor], speed: float) -> None:
    """bias_i += speed * sign(mean load - load_i): overloaded experts get chosen less next step.
    Every rank applies the same update from the same all-reduced counts, so biases stay identical."""
    if speed <= 0:
        return
    for moe, load in zip(moe_layers(model), loads):
        bias = moe.gate.e_score_correction_bias
        if bias is not None:
            bias.add_(speed * torch.sign(load.mean() - load).to(bias.device, bias.dtype))


def expert_imbalance(loads: list[torch.Tensor]) -> float:
    """Worst layer's max/mean tokens per expert (1.0 = perfectly balanced)."""
    ratios = [float(l.max() / l.mean()) for l in loads if l.sum() > 0]
    return max(ratios) if ratios else 1.0
