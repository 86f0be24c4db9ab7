"""What LoRA (``[lora]``, ``models/lora.py``) changes in the planner's memory model.

- **State.** The base is frozen and stored in the compute dtype: it has no gradient, no AdamW state and
  no fp32 master, but is still sharded (and, under FSDP, gathered) exactly as a full fine-tune's
  parameters. The adapters (``models.lora.adapter_weights``: A ``[r, in]``, B ``[out, r]``; routed
  experts ``[E, r, in]`` / ``[E, out, r]``) are ordinary trainable parameters: fp32 masters, fp32
  gradients and AdamW's two moments. TP shards an adapter to match its base layer: a column-wise base's B
  by rows, a row-wise base's A by columns, the other factor replicated; experts' adapters go with their
  expert (dim 0) under TP and EP.
- **Activations** (measured with ``saved_tensors_hooks`` and ``MemTracker`` on torch 2.13: a linear, a
  grouped GEMM or a norm's weight multiply whose weight needs no gradient saves nothing of its input):
  the norms lose their normalised value and a MoE router its fp32 copy of the input (kept for their
  weights' gradients); each adapter adds its r-wide intermediate ``x @ A^T`` (kept for B's gradient); a
  projection input no adapter reads is no longer saved, one that an adapter reads is saved as before
  (for A's gradient). With ``lora.dropout`` each adapter keeps its dropped input and the mask (in the
  input's dtype) instead. Under ``selective`` checkpointing the adapters' matmul outputs (r-wide and
  out-wide) are kept like the base's.
- **Communication.** FSDP still gathers base and adapters in the compute dtype, but only the adapters
  have gradients to hold unsharded and reduce-scatter.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from seektrain.models import COLWISE, EXPERTS, LINEAR, ROWWISE, ROWWISE_PARTIAL
from seektrain.models.config import ModelConfig
from seektrain.models.lora import LoraSpec, adapter_weights
from seektrain.models.registry import family_for

FP32 = 4


@dataclass(frozen=True)
class Adapter:
    """One adapted base weight as the memory model reads it: state-dict names, shapes and the dimension
    TP shards of A and B (``tensor_parallel.py``'s ``AdaptedColwise``/``AdaptedRowwise``: a column-wise
    base's B by rows, a row-wise base's A by columns; experts' both by expert), and the base's facts."""

    path: str
    a_name: str
    a_shape: tuple[int, ...]
    a_tp: int | None
    b_name: str
    b_shape: tuple[int, ...]
    b_tp: int | None
    expert: bool
    in_features: int
    out_features: int
    tp: str  # the base weight's TP style
    block: int | None  # the config layer index of the enclosing block (MTP depth k: L + k)
    layer: int | None  # decoder layer index, None outside the decoder layers
    part: str  # where a pipeline keeps it (``Weight.part``)


@functools.lru_cache(maxsize=16)
def _adapters_cached(cfg_json: str, spec: LoraSpec) -> tuple[Adapter, ...]:
    out = []
    for shapes in adapter_weights(ModelConfig.from_dict(json.loads(cfg_json)), spec).values():
        w = shapes.weight
        a_tp: int | None
        b_tp: int | None
        if w.kind == EXPERTS:
            a_tp, b_tp = 0, 0
        else:
            a_tp = 1 if w.tp in (ROWWISE, ROWWISE_PARTIAL) else None
            b_tp = 0 if w.tp == COLWISE else None
        out.append(
            Adapter(
                w.path, shapes.a_name, shapes.a, a_tp, shapes.b_name, shapes.b, b_tp, w.kind == EXPERTS,
                w.in_features, w.out_features, w.tp, w.block, w.layer, w.part,
            )
        )  # fmt: skip
    return tuple(out)


def adapters(cfg: ModelConfig, spec: LoraSpec) -> tuple[Adapter, ...]:
    """Every adapted base weight of ``cfg`` under ``spec`` (``models.lora.adapter_weights``; cached)."""
    return _adapters_cached(json.dumps(cfg.to_dict(), sort_keys=True), spec)


# ----------------------------------------------------------------------------- activations
def _block_adapters(cfg: ModelConfig, lora: LoraSpec, block: int) -> list[Adapter]:
    return [ad for ad in adapters(cfg, lora) if ad.block == block]


def _norm_widths(cfg: ModelConfig) -> tuple[float, float]:
    """(sequence-sharded, replicated) norm widths in one decoder block: the two residual norms, and those
    TP replicates (``FamilyCosts.replicated_norm_width``: MLA's q_a/kv_a norms)."""
    return 2 * cfg.hidden_size, family_for(cfg).costs.replicated_norm_width(cfg)


# projections that read one tensor (a block's attention input, an MLP's input): one saved input between them
_SHARED_INPUT = dict.fromkeys(("q_proj", "q_a_proj", "kv_a_proj_with_mqa", "k_proj", "v_proj"), "input")
_SHARED_INPUT.update(gate_proj="input", up_proj="input")


@dataclass(frozen=True)
class _Input:
    """A tensor of a block that only projections read (the attention input, MLA's normed latents, o_proj's,
    an MLP's and a down projection's input, a routed slot): saved only by adapters once the base is frozen."""

    width: float  # elements per token on this rank (a row-wise projection's input: 1/tp of it)
    per_token: float  # 1, or k/tp routed slots
    consumers: tuple[str, ...]  # the projections (Weight.path) that read it


def _inputs(cfg: ModelConfig, block: int, tp: int) -> list[_Input]:
    groups: dict[str, list] = {}
    for w in family_for(cfg).weights(cfg).values():
        if (
            w.block != block
            or w.kind not in (LINEAR, EXPERTS)
            or not (".self_attn." in w.path or ".mlp." in w.path)
        ):
            continue
        parent, name = w.path.rsplit(".", 1)
        groups.setdefault(f"{parent}:{_SHARED_INPUT.get(name, name)}", []).append(w)
    out = []
    for ws in groups.values():
        w = ws[0]
        width = w.in_features / tp if w.tp in (ROWWISE, ROWWISE_PARTIAL) and tp > 1 else w.in_features
        per = cfg.num_experts_per_tok / tp if w.kind == EXPERTS else 1.0
        out.append(_Input(width, per, tuple(x.path for x in ws)))
    return out


def layer_delta(cfg: ModelConfig, block: int, lora: LoraSpec, a: int, tp: int) -> float:
    """Bytes per token a decoder block saves for backward under LoRA minus what it saves in a full
    fine-tune (no checkpointing): each norm's normalised value and a MoE router's fp32 copy of its input
    go (they were kept for their weights' gradients); each adapter keeps its r-wide intermediate; an
    input that no adapter reads goes; with dropout, an adapter keeps its dropped input and the mask (in
    the input's dtype, as torch's CPU and CUDA kernels return it) instead of the input."""
    seq, replicated = _norm_widths(cfg)
    delta = -a * (seq / tp + replicated)
    if cfg.is_moe_layer(block):
        delta -= FP32 * cfg.hidden_size
    adapted = {ad.path: ad for ad in _block_adapters(cfg, lora, block)}
    for ad in adapted.values():
        delta += (cfg.num_experts_per_tok / tp if ad.expert else 1.0) * a * lora.rank
    for tensor in _inputs(cfg, block, tp):
        readers = [p for p in tensor.consumers if p in adapted]
        if not readers or lora.dropout:
            delta -= tensor.per_token * a * tensor.width
        if lora.dropout:
            delta += len(readers) * tensor.per_token * 2 * a * tensor.width
    return delta


def selective_delta(cfg: ModelConfig, block: int, lora: LoraSpec, a: int, tp: int) -> float:
    """What a selectively checkpointed block keeps in addition: each adapter's two matmul outputs."""
    total = 0.0
    for ad in _block_adapters(cfg, lora, block):
        out = ad.out_features / tp if ad.tp == COLWISE and tp > 1 else ad.out_features
        total += (cfg.num_experts_per_tok / tp if ad.expert else 1.0) * a * (lora.rank + out)
    return total


def head_delta(cfg: ModelConfig, lora: LoraSpec, a: int, tp: int, use_mtp: bool) -> float:
    """The final norm's normalised value, and per MTP depth its three norms' and the frozen ``eh_proj``'s
    input, no longer saved."""
    d = cfg.hidden_size
    delta = -a * d / tp
    if use_mtp:  # models/lora.py never adapts eh_proj
        delta -= cfg.num_nextn_predict_layers * (3 * a * d / tp + 2 * a * d)
    return delta
