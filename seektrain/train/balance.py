"""MoE load balancing across ranks: DeepSeek-V3's auxiliary-loss-free bias update, the sequence-wise
auxiliary loss knobs, and the expert-load statistics we log: the worst layer's imbalance, and each
layer's health (load, router entropy, bias spread) so that one collapsing layer shows before the loss
does.

Everything here stays on the device: the step hands the tensors to ``train/step_log.py``, which reads
them on flush steps only."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from seektrain.models import MoE
from seektrain.models.autograd_phase import in_backward
from seektrain.observe.names import layer_key


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


class RouterEntropy:
    """Each MoE layer's mean routing entropy: the entropy of a token's router scores normalised to sum
    to 1, averaged over the tokens routed since the last ``take``. A forward hook on each router reads
    the scores the router returns, so the model knows nothing of it; training forwards only (not
    evaluation, nor activation checkpointing's recomputation in backward, which would count twice).
    Kept on the device as one (entropy sum, tokens) pair per layer and forward, like the MoE layers'
    ``expert_counts``, so that ``keep_last_forwards`` can drop a forward that must not count."""

    def __init__(self, model: nn.Module):
        self.layers = moe_layers(model)
        self.records: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self.handles = [moe.gate.register_forward_hook(self._hook(i)) for i, moe in enumerate(self.layers)]

    def _hook(self, i: int):
        @torch.compiler.disable  # a list updated per call: traced, a recompile each time
        @torch.no_grad()
        def hook(router: nn.Module, args, output) -> None:
            if not router.training or in_backward():
                return
            scores = output[2].detach()  # Router.forward's (weights, indices, scores)
            probs = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
            entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)
            self.records[i].append(torch.stack([entropy.sum(), entropy.new_full((), entropy.numel())]))

        return hook

    def take(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """[layers, 2] (entropy sum, tokens) since the last call, summed over ``group``; resets."""
        device = self.layers[0].gate.weight.device
        stats = torch.stack(
            [torch.stack(r).sum(0) if r else torch.zeros(2, device=device) for r in self.records]
        )
        self.records = [[] for _ in self.layers]
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        return stats


def keep_last_forwards(model: nn.Module, entropy: RouterEntropy | None, n: int) -> None:
    """Keep only each MoE layer's last ``n`` training forwards in its expert counts and router entropy.
    A pipeline schedule's first step (and its first after a forward-only evaluation) runs every stage
    once more before the micro-batches, to infer the shapes it sends between stages
    (``torch.distributed.pipelining``'s metadata inference: on the first micro-batch on the first
    stage, on placeholder activations on the others); one process runs no such forward."""
    for moe in moe_layers(model):
        del moe.expert_counts[:-n]
    for records in entropy.records if entropy is not None else ():
        del records[:-n]


# Columns of the per-layer table (layer_table); HELD: the layer is an MoE layer of this model.
HELD, HAS_BIAS, MAX_OVER_MEAN, TOP_SHARE, ENTROPY, BIAS_SPREAD = range(6)
_LAYER_INDEX = re.compile(r"(?:^|\.)(layers|mtp)\.(\d+)(?:\.|$)")


def moe_layer_ids(model: nn.Module, n_layers: int) -> list[int]:
    """The layer index of each MoE layer, in ``moe_layers`` order, from its module path: ``layers.3.mlp``
    is 3 (global under pipeline parallelism; wrappers add names, not numbers), ``mtp.0.block.mlp`` is
    ``n_layers`` + 0, as DeepSeek-V3's checkpoint numbers its MTP layer (61)."""
    ids = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            match = _LAYER_INDEX.search(name)
            assert match is not None, f"MoE module {name!r} has no layer index in its path"
            ids.append(int(match.group(2)) + (n_layers if match.group(1) == "mtp" else 0))
    return ids


@torch.no_grad()
def layer_table(
    model: nn.Module,
    loads: list[torch.Tensor],
    entropy: torch.Tensor,
    n_layers: int,
    mtp_layers: int = 0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """[n_layers + mtp_layers, 6] float64 on the device, one row per layer (``moe_layer_ids``; zeros where a
    layer is dense or on another pipeline stage; under pipeline parallelism the stages' rows are summed, each layer
    being on one stage): ``loads`` are the data-parallel-summed tokens per expert (collect_expert_load),
    ``entropy`` RouterEntropy.take's sums. Columns: HELD, HAS_BIAS, MAX_OVER_MEAN (busiest expert's
    tokens over the mean), TOP_SHARE (its share of the layer's slots), ENTROPY (mean per token),
    BIAS_SPREAD (max - min of the V3 bias)."""
    layers = moe_layers(model)
    device = entropy.device
    rows = [torch.zeros(6, dtype=torch.float64, device=device)] * (n_layers + mtp_layers)
    for layer, moe, load, (h_sum, tokens) in zip(moe_layer_ids(model, n_layers), layers, loads, entropy):
        load = load.to(device, torch.float64)
        total, busiest = load.sum(), load.amax()
        seen = total > 0
        bias = moe.gate.e_score_correction_bias
        spread = (bias.amax() - bias.amin()).to(device, torch.float64) if bias is not None else total * 0
        rows[layer] = torch.stack(
            [
                torch.ones_like(total),
                torch.full_like(total, float(bias is not None)),
                torch.where(seen, busiest * load.numel() / total.clamp_min(1), 1.0),
                torch.where(seen, busiest / total.clamp_min(1), 0.0),
                h_sum.double() / tokens.double().clamp_min(1),
                spread,
            ]
        )
    table = torch.stack(rows)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(table, group=pp_group)
    return table


def layer_metrics(flat: list[float]) -> dict[str, float]:
    """The table, read on the host as a flat list, as metric keys ``names.LAYER_KEYS``/layerN."""
    out = {}
    for layer in range(len(flat) // 6):
        row = flat[layer * 6 : layer * 6 + 6]
        if not row[HELD]:
            continue
        out[layer_key("moe_load_max_over_mean", layer)] = row[MAX_OVER_MEAN]
        out[layer_key("moe_top_expert_share", layer)] = row[TOP_SHARE]
        out[layer_key("moe_router_entropy", layer)] = row[ENTROPY]
        if row[HAS_BIAS]:
            out[layer_key("moe_bias_spread", layer)] = row[BIAS_SPREAD]
    return out
