"""What LoRA (``[lora]``, ``models/lora.py``) changes in the planner's memory model.

- **State.** The base is frozen and stored in the compute dtype: it has no gradient, no AdamW state and
  no fp32 master, but is still sharded (and, under FSDP, gathered) exactly as a full fine-tune's
  parameters. The adapters (``models.lora.adapter_weights``: A ``[r, in]``, B ``[out, r]``; routed
  experts ``[E, r, in]`` / ``[E, out, r]``) are ordinary trainable parameters: fp32 masters, fp32
  gradients and AdamW's two moments. TP shards an adapter to match its base layer: a column-wise base's B
  by rows, a row-wise base's A by columns, the other factor replicated; experts' adapters go with their
  expert (dim 0) under TP and EP.
- **Activations** (measured with ``saved_tensors_hooks`` on torch 2.13: a linear, a grouped GEMM or a
  norm's weight multiply whose weight needs no gradient saves nothing of its input): the norms lose their
  normalised value (kept only for the weight's gradient); each adapted projection adds its r-wide
  intermediate ``x @ A^T`` (kept for B's gradient; its input, kept for A's gradient, is the one the base
  projection used to keep), per routed slot for the experts, and with ``lora.dropout`` the dropped input
  and its mask. A frozen projection outside the targets still counts its input (an over-prediction for
  partial targets, never an under-prediction). Under ``selective`` checkpointing the adapters' matmul
  outputs (r-wide and out-wide) are kept like the base's.
- **Communication.** FSDP still gathers base and adapters in the compute dtype, but only the adapters
  have gradients to hold unsharded and reduce-scatter.
"""

from __future__ import annotations

import fnmatch
import functools
import json
from dataclasses import dataclass

from seektrain.models.config import ModelConfig
from seektrain.models.shapes import COLWISE, EXPERTS, LINEAR, ROWWISE, ROWWISE_PARTIAL, weights_by_path

MASK = 1  # bytes per element of dropout's boolean mask


@dataclass(frozen=True)
class LoraPlan:
    """The ``[lora]`` keys the memory model needs (None when ``lora.enabled`` is false)."""

    rank: int
    dropout: float
    targets: tuple[str, ...]


def lora_of(job) -> LoraPlan | None:
    lora = job.lora
    return LoraPlan(lora.rank, lora.dropout, tuple(lora.target_modules)) if lora.enabled else None


@dataclass(frozen=True)
class Adapter:
    """One adapted base weight: its path, the shapes and TP dims of A and B, whether it groups experts,
    its input width and its decoder block (config layer index)."""

    path: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    a_tp: int | None
    b_tp: int | None
    expert: bool
    in_features: int
    out_features: int
    tp: str  # the base weight's TP style
    block: int | None


def _group(path: str, kind: str) -> str | None:
    if kind == EXPERTS:
        return "experts"
    if kind != LINEAR:
        return None
    if ".self_attn." in path:
        return "attention"
    if ".mlp.shared_experts." in path:
        return "shared_experts"
    if ".mlp." in path:
        return "mlp"
    return None


def _targeted(path: str, kind: str, targets: tuple[str, ...]) -> bool:
    """The target groups and fnmatch patterns of ``lora.target_modules`` (docs/finetuning.md)."""
    if kind not in (LINEAR, EXPERTS) or path in ("lm_head",):
        return False
    group = _group(path, kind)
    return any(t == group or fnmatch.fnmatchcase(path, t) for t in targets)


# TEMPORARY until the LoRA core (models/lora.py) is merged: its adapter_weights replaces this walk.
@functools.lru_cache(maxsize=16)
def _adapters_cached(cfg_json: str, rank: int, targets: tuple[str, ...]) -> tuple[Adapter, ...]:
    out = []
    for w in weights_by_path(ModelConfig.from_dict(json.loads(cfg_json))).values():
        if w.tied_to or not _targeted(w.path, w.kind, targets):
            continue
        if w.kind == EXPERTS:
            a, b, a_tp, b_tp = (w.experts, rank, w.in_features), (w.experts, w.out_features, rank), 0, 0
        else:
            a, b = (rank, w.in_features), (w.out_features, rank)
            a_tp = 1 if w.tp in (ROWWISE, ROWWISE_PARTIAL) else None
            b_tp = 0 if w.tp == COLWISE else None
        out.append(Adapter(w.path, a, b, a_tp, b_tp, w.kind == EXPERTS, w.in_features, w.out_features, w.tp, w.block))
    return tuple(out)


def adapters(cfg: ModelConfig, lora: LoraPlan) -> tuple[Adapter, ...]:
    """Every adapted base weight of ``cfg`` under ``lora`` (cached per config)."""
    return _adapters_cached(json.dumps(cfg.to_dict(), sort_keys=True), lora.rank, lora.targets)


def adapter_param_names(adapter: Adapter) -> tuple[str, str]:
    """The state_dict names of A and B (LORA_SPEC: ``P.lora_A``/``P.lora_B``; experts per projection)."""
    if adapter.expert:
        return f"{adapter.path}_lora_A", f"{adapter.path}_lora_B"
    return f"{adapter.path}.lora_A", f"{adapter.path}.lora_B"


# ----------------------------------------------------------------------------- activations
def _block_adapters(cfg: ModelConfig, lora: LoraPlan, block: int) -> list[Adapter]:
    return [ad for ad in adapters(cfg, lora) if ad.block == block]


def _norm_widths(cfg: ModelConfig) -> tuple[float, float]:
    """(sequence-sharded, replicated) norm widths in one decoder block: the two residual norms, and MLA's
    q_a/kv_a norms."""
    replicated = (cfg.kv_lora_rank or 0) + (cfg.q_lora_rank or 0) if cfg.is_mla else 0
    return 2 * cfg.hidden_size, replicated


def _per_token(ad: Adapter, cfg: ModelConfig, tp: int) -> float:
    """How many times one token passes through ``ad`` on a rank: once, or k/tp routed slots."""
    return cfg.num_experts_per_tok / tp if ad.expert else 1.0


def _in_width(ad: Adapter, tp: int) -> float:
    return ad.in_features / tp if ad.tp in (ROWWISE, ROWWISE_PARTIAL) and tp > 1 else ad.in_features


def layer_delta(cfg: ModelConfig, block: int, lora: LoraPlan, a: int, tp: int) -> float:
    """Bytes per token a decoder block saves for backward under LoRA minus what it saves in a full
    fine-tune (no checkpointing)."""
    seq, replicated = _norm_widths(cfg)
    delta = -a * (seq / tp + replicated)
    for ad in _block_adapters(cfg, lora, block):
        per = _per_token(ad, cfg, tp)
        delta += per * a * lora.rank
        if lora.dropout:
            delta += per * (a + MASK) * _in_width(ad, tp)
    return delta


def selective_delta(cfg: ModelConfig, block: int, lora: LoraPlan, a: int, tp: int) -> float:
    """What a selectively checkpointed block keeps in addition: each adapter's two matmul outputs."""
    total = 0.0
    for ad in _block_adapters(cfg, lora, block):
        out = ad.out_features / tp if ad.tp == COLWISE and tp > 1 else ad.out_features
        total += _per_token(ad, cfg, tp) * a * (lora.rank + out)
    return total


def head_delta(cfg: ModelConfig, lora: LoraPlan, a: int, tp: int, use_mtp: bool) -> float:
    """The final norm's normalised value, and per MTP depth its three norms' and (unless adapted) the
    frozen ``eh_proj``'s input, no longer saved."""
    d = cfg.hidden_size
    delta = -a * d / tp
    if use_mtp:
        adapted = {ad.path for ad in adapters(cfg, lora)}
        for k in range(cfg.num_nextn_predict_layers):
            delta -= 3 * a * d / tp
            if f"mtp.{k}.eh_proj" not in adapted:
                delta -= 2 * a * d
    return delta
