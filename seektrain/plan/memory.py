"""Per-rank memory of a run plan, itemised: what the planner and ``parallel.auto`` compare with a
device's memory.

Two kinds of items:

- **State** (parameters, gradients, AdamW moments) is predicted exactly, by applying the layout rules of
  ``seektrain.parallel`` to the parameter shapes and TP styles of the model's shape description
  (``seektrain/models/deepseek/shapes.py``): the pipeline keeps a stage's
  layers (embedding on the first stage, norm/head/MTP on the last); tensor parallelism shards
  column-wise weights on dim 0 and row-wise ones on dim 1, routed experts by expert; expert parallelism
  splits experts over ``ep``; FSDP2 then cuts dim 0 of each local tensor into ``torch.chunk`` pieces
  (ceil-sized, the last ones shorter) over ``dp_shard × cp`` (experts: over the expert-FSDP ranks, what is
  left of ``dp_shard × cp`` after expert parallelism took its share). Parameters
  are fp32 master weights whatever the compute dtype, gradients likewise, and fused AdamW keeps two fp32
  moments per element plus a 4-byte step per parameter tensor.
- **Transients** (activations, logits, MoE dispatch, gathered parameters) are an analytic model of the
  tensors our modules save for backward, counted per layer and per token of this rank (context
  parallelism gives each cp rank ``seq_len / cp`` of every sequence, so every per-token term shrinks by
  ``cp``; the ring adds its travelling key/value chunks); ``tests/test_plan_accuracy.py`` compares it
  with ``MemTracker`` on CPU. Allocator fragmentation and the CUDA context are an allowance, stated here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from seektrain.models import EXPERTS
from seektrain.models.config import ModelConfig
from seektrain.models.lora import LoraSpec
from seektrain.models.registry import family_for, get_family
from seektrain.plan import lora_memory
from seektrain.plan.pipeline_split import stage_ids
from seektrain.plan.recompute import SELECTIVE, checkpoint_every

FP32 = 4
FRAGMENTATION = 0.05  # share of the tensor peak lost to allocator fragmentation (an allowance)


# ----------------------------------------------------------------------------- parameter shapes
@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    layer: int | None  # decoder layer index, None outside the decoder layers
    part: str  # "embed" | "layer" | "head" (final norm, lm_head, MTP)
    tp_dim: int | None  # dimension tensor parallelism shards, None = replicated
    expert: bool  # a routed-expert weight (sharded by expert under TP or EP)


def _family_cfg(cfg_json: str):
    """(family, config) of a cache key: the config's family's class and name ride along in the JSON."""
    data = json.loads(cfg_json)
    family = get_family(data.pop("family"))
    config_class: Any = family.config_class  # every family's config has from_dict
    return family, config_class.from_dict(data)


def _key(cfg) -> str:
    return json.dumps({**cfg.to_dict(), "family": family_for(cfg).name}, sort_keys=True)


@functools.lru_cache(maxsize=16)
def _specs_cached(cfg_json: str) -> tuple[ParamSpec, ...]:
    family, cfg = _family_cfg(cfg_json)
    weights = family.weights(cfg).values()
    rules = family.pipeline

    def part(w) -> str:  # where the family's pipeline keeps the weight
        top = w.path.split(".", 1)[0]
        return "embed" if top in rules.first else "head" if top in rules.last else "layer"

    return tuple(
        ParamSpec(name, shape, w.layer, part(w), tp_dim, w.kind == EXPERTS)
        for w in weights
        for name, shape, tp_dim in w.params()
    )


def param_specs(cfg: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every parameter of the model (MTP included) with its shape and the dimension TP shards, from the
    model's shape description (``seektrain/models/deepseek/shapes.py``; nothing is built)."""
    return _specs_cached(_key(cfg))


@functools.lru_cache(maxsize=16)
def _adapter_specs_cached(cfg_json: str, lora: LoraSpec) -> tuple[ParamSpec, ...]:
    cfg = _family_cfg(cfg_json)[1]
    out = []
    for ad in lora_memory.adapters(cfg, lora):
        out.append(ParamSpec(ad.a_name, ad.a_shape, ad.layer, ad.part, ad.a_tp, ad.expert))
        out.append(ParamSpec(ad.b_name, ad.b_shape, ad.layer, ad.part, ad.b_tp, ad.expert))
    return tuple(out)


def adapter_specs(cfg: ModelConfig, lora: LoraSpec) -> tuple[ParamSpec, ...]:
    """The LoRA adapters' parameters (A and B of every adapted weight), laid out like ``param_specs``."""
    return _adapter_specs_cached(_key(cfg), lora)


def _chunk_rows(n: int, parts: int, index: int) -> int:
    """Rows of piece ``index`` when ``torch.chunk`` cuts ``n`` rows into ``parts`` (FSDP2's sharding)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


# ----------------------------------------------------------------------------- rank coordinates
@dataclass(frozen=True)
class RankCoords:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 0

    def fsdp_index(self, plan) -> int:
        """This rank's place in the FSDP group, ``dp_shard × cp`` flattened (cp innermost)."""
        return self.dp_shard * plan.cp + self.cp


def rank_coords(plan, rank: int) -> RankCoords:
    """Coordinates of ``rank`` on the world mesh (pp, dp_replicate, dp_shard, cp, tp), row-major as
    ``seektrain.parallel.mesh.build_meshes`` lays it out."""
    tp = rank % plan.tp
    rest = rank // plan.tp
    cp = rest % plan.cp
    rest //= plan.cp
    shard = rest % plan.dp_shard
    rest //= plan.dp_shard
    return RankCoords(rest // plan.dp_replicate, rest % plan.dp_replicate, shard, tp, cp)


def fsdp_ranks(plan) -> int:
    """Ranks FSDP shards a parameter over: the data-parallel shard ranks and the cp ranks together (a
    cp group holds one replica between them, as torchtitan does)."""
    return plan.dp_shard * plan.cp


def _local_numel(
    spec: ParamSpec, plan, at: RankCoords, keep_layers: set[int], first: bool, last: bool
) -> int:
    if spec.part == "layer" and spec.layer not in keep_layers:
        return 0
    if (spec.part == "embed" and not first) or (spec.part == "head" and not last):
        return 0
    shape = list(spec.shape)
    if spec.expert and plan.ep > 1:
        shape[0] //= plan.ep
    elif spec.tp_dim is not None and plan.tp > 1:
        shape[spec.tp_dim] //= plan.tp
    if plan.uses_fsdp:
        parts, index = fsdp_ranks(plan), at.fsdp_index(plan)
        if spec.expert and plan.ep > 1:  # expert parallelism took ep/tp of the FSDP ranks
            in_ep = plan.ep // plan.tp if plan.tp > 1 else plan.ep
            parts, index = parts // in_ep, index // in_ep
        shape[0] = _chunk_rows(shape[0], parts, index)
    return _numel(tuple(shape))


@dataclass(frozen=True)
class StateBytes:
    params: int  # fp32 master weights held by this rank (under LoRA: the adapters')
    grads: int  # fp32 gradients (sharded like the parameters)
    optimizer: int  # AdamW: exp_avg + exp_avg_sq (fp32) + one 4-byte step per parameter tensor
    tensors: int  # trained parameter tensors of this rank's stages (an empty FSDP shard counts too)
    frozen: int = 0  # LoRA: the frozen base in the compute dtype (no gradient, no optimizer state)


def state_bytes(plan, rank: int = 0) -> StateBytes:
    """Exact bytes of parameters, gradients and AdamW state on ``rank`` of ``plan`` (a ``RunPlan``); under
    LoRA the base's bytes (compute dtype) apart and the trained state the adapters'."""
    at = rank_coords(plan, rank)
    if plan.pp > 1:
        n_stages = len(plan.pp_stage_layers)
        ids = stage_ids(at.pp, plan.pp, plan.pp_stages_per_rank, plan.job.parallel.pp_schedule)
        keep = {layer for i in ids for layer in plan.pp_stage_layers[i]}
        first, last = 0 in ids, n_stages - 1 in ids
    else:
        keep, first, last = set(range(plan.model.num_hidden_layers)), True, True
    lora = plan.lora
    base = sum(_local_numel(spec, plan, at, keep, first, last) for spec in param_specs(plan.model))
    if lora is not None:
        trained = adapter_specs(plan.model, lora)
        frozen = plan.compute_dtype.itemsize * base
    else:
        trained, frozen = param_specs(plan.model), 0
    numel = grad_numel = tensors = 0
    for spec in trained:
        n = _local_numel(spec, plan, at, keep, first, last)
        numel += n
        grad_numel += n
        if spec.part == "embed" and first and plan.tp > 1 and not plan.uses_fsdp:
            # measured: the vocabulary-sharded embedding's gradient is a whole (Replicate) table
            grad_numel += n * (plan.tp - 1)
        tensors += _held(spec, keep, first, last)
    return StateBytes(FP32 * numel, FP32 * grad_numel, 2 * FP32 * numel + FP32 * tensors, tensors, frozen)


def _held(spec: ParamSpec, keep: set[int], first: bool, last: bool) -> bool:
    """Whether this rank's stages hold the parameter (an empty FSDP shard still gets an AdamW step)."""
    if spec.part == "layer":
        return spec.layer in keep
    return first if spec.part == "embed" else last


def max_state_bytes(plan) -> StateBytes:
    """The rank with the most state: FSDP's first shard is the largest; every pipeline rank differs."""
    ranks = range(0, plan.world_size, plan.world_size // plan.pp)
    return max((state_bytes(plan, r) for r in ranks), key=lambda s: s.params + s.optimizer + s.frozen)


# ----------------------------------------------------------------------------- activations
def _norm(width: int, a: int, tp: int) -> float:
    """RMSNorm over ``width`` per token: its fp32 input, the normalised value (saved by the weight's
    multiply) and its output (saved by the next matmul); under TP+SP those are sequence-sharded and the
    matmul saves the all-gathered output instead."""
    sharded = (FP32 + 2 * a) * width / tp
    return sharded + (a * width if tp > 1 else 0)


def _dense_mlp(cfg: ModelConfig, a: int, tp: int) -> float:
    """A dense layer's MLP, by its family (``FamilyCosts.dense_mlp_bytes``)."""
    return family_for(cfg).costs.dense_mlp_bytes(cfg, a, tp)


def _moe(cfg: ModelConfig, a: int, tp: int, ep: int) -> float:
    """A MoE layer's MLP, by its family (``FamilyCosts.moe_bytes``)."""
    return family_for(cfg).costs.moe_bytes(cfg, a, tp, ep)


def _attention(cfg: ModelConfig, a: int, tp: int, pad_values: bool, ring: bool = False) -> float:
    """Bytes per token saved by attention after its input norm, by its family
    (``FamilyCosts.attention_bytes``)."""
    return family_for(cfg).costs.attention_bytes(cfg, a, tp, pad_values, ring)


def layer_activation_bytes(
    cfg: ModelConfig, layer: int, a: int, tp: int, ep: int, pad_values: bool, ring: bool = False
) -> float:
    """Bytes per token (of the micro-batch's sequence, before SP's split) one decoder layer keeps for
    backward without checkpointing; ``ring``: attention is context parallelism's ring."""
    d = cfg.hidden_size
    mlp = _moe(cfg, a, tp, ep) if cfg.is_moe_layer(layer) else _dense_mlp(cfg, a, tp)
    return 2 * _norm(d, a, tp) + _attention(cfg, a, tp, pad_values, ring) + mlp


@dataclass(frozen=True)
class Selective:
    """Bytes per token of one selectively checkpointed layer (``train.activation_checkpoint=selective``):
    ``kept`` from its forward to its backward; ``tail``, the part of it still held while the layer's backward
    runs beside the tensors recomputation rebuilds (the layer's input, and the outputs of its last matmul
    and collective, which recomputation stops short of: it ends once every tensor backward needs exists)."""

    kept: float
    tail: float


def _row_output(d: int, a: int, tp: int) -> float:
    """A row-wise projection's output (the full-sequence partial sum under TP) and, under TP+SP, the
    sequence shard its reduce-scatter returns: both are kept (a matmul's output and a collective's)."""
    return a * d + (a * d / tp if tp > 1 else 0)


def _selective_attention(cfg: ModelConfig, a: int, tp: int, pad_values: bool) -> float:
    """The projections' outputs, the attention kernel's output and fp32 log-sum-exp (by the family:
    ``FamilyCosts.selective_attention_bytes``), o_proj's output."""
    kept = family_for(cfg).costs.selective_attention_bytes(cfg, a, tp, pad_values)
    return kept + _row_output(cfg.hidden_size, a, tp)


def _selective_mlp(cfg: ModelConfig, layer: int, a: int, tp: int, ep: int) -> tuple[float, float]:
    """(kept, its tail). Dense: gate, up and down outputs. MoE: by its family
    (``FamilyCosts.selective_moe_bytes``)."""
    d = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 2 * a * cfg.intermediate_size / tp + _row_output(d, a, tp), _row_output(d, a, tp)
    return family_for(cfg).costs.selective_moe_bytes(cfg, a, tp, ep)


def layer_selective_bytes(
    cfg: ModelConfig, layer: int, a: int, tp: int, ep: int, pad_values: bool
) -> Selective:
    """What one selectively checkpointed decoder layer keeps for backward, per token: its input (the
    checkpoint's), under TP+SP the two all-gathered norm outputs, and the outputs of every matmul, attention
    kernel and collective inside it (seektrain/parallel/activation_checkpoint.py)."""
    d = cfg.hidden_size
    gathered = 2 * a * d if tp > 1 else 0.0  # attention's and the MLP's inputs
    mlp, tail = _selective_mlp(cfg, layer, a, tp, ep)
    return Selective(
        a * d / tp + gathered + _selective_attention(cfg, a, tp, pad_values) + mlp, a * d / tp + tail
    )


def selective_rebuilt_bytes(
    cfg: ModelConfig, layer: int, a: int, tp: int, ep: int, pad_values: bool, ring: bool = False
) -> float:
    """Bytes per token recomputation writes in a selectively checkpointed layer's backward: what the layer
    saves without checkpointing, less what it kept (the tail aside, which stays beside the rebuilt tensors)."""
    s = layer_selective_bytes(cfg, layer, a, tp, ep, pad_values)
    return max(0.0, layer_activation_bytes(cfg, layer, a, tp, ep, pad_values, ring) + s.tail - s.kept)


@dataclass(frozen=True)
class Activations:
    layers: float  # saved by the decoder layers of this rank, all in-flight micro-batches
    backward: float  # working set of backward: activation gradients, half the largest layer's tensors
    recompute: float  # one layer's activations rebuilt in backward (checkpointing)
    head: float  # final norm, logits/loss buffer (fused or not), MTP
    moe_dispatch: float  # all-to-all send buffer of one MoE layer (EP)
    in_flight: int  # micro-batches whose activations a pipeline rank holds at once
    # the head's backward working set counts under checkpointing too: with a frozen base (LoRA) no
    # gradients pile up during backward to move the step's peak to a later layer (measured)
    head_working_set: bool = False
    cp_ring: float = 0.0  # context parallelism: the key/value chunks (and their gradients) in the ring

    def phases(self, root_buffer: float = 0.0, layer_buffer: float = 0.0) -> tuple[float, float]:
        """Peak bytes in the two moments backward can peak: the head's backward (every saved tensor, the
        head's, the root FSDP unit gathered; plus the working set unless layers are recomputed later)
        and a decoder layer's backward (its recomputed tensors, the working set, its unit gathered, and
        under context parallelism the ring's chunks)."""
        working = self.backward if self.head_working_set or not self.recompute else 0.0
        head = self.layers + self.head + root_buffer + working
        layer = self.layers + self.recompute + self.backward + layer_buffer + self.cp_ring
        return head + self.moe_dispatch, layer + self.moe_dispatch

    @property
    def total(self) -> float:
        return max(self.phases())


def in_flight_microbatches(schedule: str, pp: int, n_micro: int) -> int:
    """Micro-batches a pipeline rank with ``pp`` stages from it to the end holds activations of: all of
    them under GPipe, ``pp`` under 1F1B and zero-bubble V (the first rank is the busiest); interleaved
    1F1B runs ahead by about one more round of its stages."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n_micro
    if schedule == "interleaved-1f1b":
        return min(n_micro, 2 * pp)
    return min(n_micro, pp)


# ----------------------------------------------------------------------------- context parallelism
# What the ring (seektrain/parallel/ring_attention.py) holds while one layer's attention backward runs,
# besides what attention saved and the backward working set (its query and output gradients), per token
# of this rank: the [k | v] chunk in the compute dtype, held and arriving (RING_KV_CHUNKS); the fp32
# accumulated dK/dV of the current step, the previous step's still being sent and its arrival
# (RING_GRAD_CHUNKS); the fp32 dQ sum; where the block kernel wants one head size (MLA on the CPU's
# flash kernel), the output and its gradient zero-padded to the query/key width. With packed documents each
# block also builds an additive [c, c] bias of the compute dtype. By then the layer's MLP backward has
# freed the MLP's saved tensors, which the ring's buffers reuse.
RING_KV_CHUNKS = 2
RING_GRAD_CHUNKS = 3


def ring_packed(plan) -> bool:
    """Whether the ring's blocks carry a document mask (``data.packing`` or ``data.document_mask``)."""
    data = plan.job.data
    return bool(data.packing or data.document_mask)


def ring_value_width(cfg: ModelConfig, device_type: str, dtype, packed: bool) -> int:
    """The value head size the ring's block kernel runs with (``platform/ring_blocks.py``): the query/key
    head size where the kernel wants one (the CPU's flash kernel: MLA's values are zero-padded), else the
    value's own (on CUDA, MLA runs the memory-efficient kernel)."""
    from seektrain.platform.ring_blocks import block_kernel

    qk = cfg.qk_head_dim
    v = cfg.value_head_dim
    return max(qk, v) if block_kernel(device_type, dtype, packed, qk == v).equal_head_dims else v


def ring_chunk_bytes(cfg: ModelConfig, tp: int, a: int, v_width: int) -> float:
    """Bytes per token of the key/value chunk the ring passes on, ``a`` bytes per element: the keys and
    (``v_width``-wide) values of this tensor-parallel rank's heads (MLA: the 192-wide key of every head,
    after the up-projection; GQA: repeated to every query head). Its gradient travels in fp32."""
    h = cfg.num_attention_heads / tp
    qk = cfg.qk_head_dim
    return a * h * (qk + v_width)


def ring_working_bytes(plan, sequences: float) -> float:
    """The ring's buffers on one rank of ``plan`` during a layer's attention backward, for ``sequences``
    sequences (see above)."""
    cfg, tp, cp, seq = plan.model, plan.tp, plan.cp, plan.job.train.seq_len
    a, packed = plan.compute_dtype.itemsize, ring_packed(plan)
    h = cfg.num_attention_heads / tp
    qk = cfg.qk_head_dim
    v = cfg.value_head_dim
    width = ring_value_width(cfg, plan.device_type, plan.compute_dtype, packed)
    per_token = RING_KV_CHUNKS * ring_chunk_bytes(cfg, tp, a, width)
    per_token += RING_GRAD_CHUNKS * ring_chunk_bytes(cfg, tp, FP32, width) + FP32 * h * qk
    if width > v:
        per_token += 2 * a * h * width
    c = seq / (2 * cp)
    bias = a * c * c * sequences if packed else 0.0
    return per_token * sequences * seq / cp + bias


def _mlp_saved(cfg: ModelConfig, layer: int, a: int, tp: int, ep: int) -> float:
    """Bytes per token layer ``layer``'s MLP (and its input norm) saves: freed by its backward before
    the attention's backward begins."""
    d = cfg.hidden_size
    mlp = _moe(cfg, a, tp, ep) if cfg.is_moe_layer(layer) else _dense_mlp(cfg, a, tp)
    return _norm(d, a, tp) + mlp


def activation_bytes(plan, pad_values: bool | None = None, pp_rank: int = 0) -> Activations:
    """Peak activation bytes of pipeline rank ``pp_rank`` of ``plan`` (the first, the busiest under 1F1B,
    by default) for one step. Every term is per token of this rank: under context parallelism a rank
    holds ``seq_len / cp`` tokens of each sequence (its two load-balanced chunks), so the layers' saved
    tensors, the logits and loss, the MoE buffers and the working sets all shrink by ``cp``; attention
    saves what flash attention saves, and the ring's chunks and gradient buffers are added to a layer's
    backward."""
    cfg, job = plan.model, plan.job
    a = plan.compute_dtype.itemsize
    if pad_values is None:
        pad_values = plan.device_type == "cpu"
    tp, ep = plan.tp, plan.ep
    d, V = cfg.hidden_size, cfg.vocab_size
    if plan.pp > 1:
        local_seqs = job.train.micro_batch_size * plan.accum_steps // plan.pp_microbatches
        ids = stage_ids(pp_rank, plan.pp, plan.pp_stages_per_rank, job.parallel.pp_schedule)
        layers = [layer for i in ids for layer in plan.pp_stage_layers[i]]
        last = len(plan.pp_stage_layers) - 1 in ids
        in_flight = in_flight_microbatches(job.parallel.pp_schedule, plan.pp - pp_rank, plan.pp_microbatches)
    else:
        local_seqs, layers, last, in_flight = (
            job.train.micro_batch_size,
            list(range(cfg.num_hidden_layers)),
            True,
            1,
        )
    tokens = local_seqs * job.train.seq_len / plan.cp
    mode = job.train.activation_checkpoint
    every = checkpoint_every(mode)
    lora = plan.lora
    ring = plan.cp > 1

    def block_bytes(i: int) -> float:  # what block i saves without checkpointing (LoRA's difference added)
        full = layer_activation_bytes(cfg, i, a, tp, ep, pad_values, ring)
        return full + (lora_memory.layer_delta(cfg, i, lora, a, tp) if lora else 0.0)

    per_layer = [block_bytes(i) for i in layers]
    if mode == SELECTIVE:  # each layer keeps its matmul/attention outputs; its backward rebuilds the rest
        selective = [layer_selective_bytes(cfg, i, a, tp, ep, pad_values) for i in layers]
        if lora:
            selective = [
                Selective(s.kept + lora_memory.selective_delta(cfg, i, lora, a, tp), s.tail)
                for i, s in zip(layers, selective)
            ]
        kept = sum(s.kept for s in selective)
        rebuilt = [max(0.0, b + s.tail - s.kept) for b, s in zip(per_layer, selective)]
    else:
        kept = sum(a * d / tp if every and i % every == 0 else b for i, b in zip(layers, per_layer))
        rebuilt = per_layer
    if plan.pp > 1:  # the schedule keeps each in-flight micro-batch's stage output (and, with MTP, the
        # label embeddings passed along) until its backward
        kept += a * d / tp * (2 if plan.use_mtp and not last else 1)
    largest = max(per_layer, default=0.0)
    recompute = max(rebuilt, default=0.0) if every else 0.0
    head = 0.0
    use_mtp = plan.use_mtp
    if last or plan.pp == 1:
        if plan.fused_loss:
            logits = a * V + a * d  # the one [tokens, vocab] buffer turned into its gradient, and h
        else:
            logits = a * V / tp + 2 * FP32 * V / tp  # logits, their fp32 copy and log-softmax
        head = _norm(d, a, tp) + logits
        if use_mtp:  # per depth: enorm and hnorm, their concatenation (eh_proj's input), a block, its
            # final norm and another logits buffer
            for k in range(cfg.num_nextn_predict_layers):
                block = block_bytes(cfg.num_hidden_layers + k)
                head += 2 * _norm(d, a, tp) + 2 * a * d + block + _norm(d, a, tp) + logits
        if lora:
            head += lora_memory.head_delta(cfg, lora, a, tp, use_mtp)
    dispatch = cfg.num_experts_per_tok * a * d / tp if cfg.is_moe and ep > 1 else 0.0
    ring_bytes = 0.0
    if ring:  # at the first layer backward meets (this rank's last), beside what its MLP freed
        freed = _mlp_saved(cfg, layers[-1], a, tp, ep) * tokens if layers else 0.0
        ring_bytes = max(0.0, ring_working_bytes(plan, local_seqs) - freed)
    return Activations(
        kept * tokens * in_flight,
        0.5 * largest * tokens,
        recompute * tokens,
        head * tokens,
        dispatch * tokens,
        in_flight,
        head_working_set=lora is not None,
        cp_ring=ring_bytes,
    )


# ----------------------------------------------------------------------------- communication buffers
def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class CommBuffers:
    root: float  # the root FSDP unit (embedding, final norm, head) gathered, with unsharded gradients
    layer: float  # the largest layer unit's gathered parameters and compute-dtype gradients
    autocast: float  # without FSDP: autocast's compute-dtype copy of every weight


def _unit_numels(plan, specs) -> dict[str, int]:
    """Elements of ``specs`` per FSDP unit (a decoder layer, an MTP depth, the root) after TP and EP."""
    units: dict[str, int] = {}
    for spec in specs:
        if spec.layer is not None:
            key = f"layer{spec.layer}"
        elif spec.name.startswith("mtp."):
            key = "mtp" + spec.name.split(".")[1]
        else:
            key = "root" if plan.pp == 1 or spec.part == "head" else "root-first"
        shape = list(spec.shape)
        if spec.expert and plan.ep > 1:
            shape[0] //= plan.ep
        elif spec.tp_dim is not None and plan.tp > 1:
            shape[spec.tp_dim] //= plan.tp
        units[key] = units.get(key, 0) + _numel(tuple(shape))
    return units


def comm_buffer_bytes(plan) -> CommBuffers:
    """Parameters and gradients that exist unsharded for a while. Under FSDP, a unit's parameters are
    gathered in the compute dtype for its forward and backward, and its gradients exist unsharded (in the
    compute dtype, and the root's also as the fp32 copy reduce-scatter sends) until reduced. Without
    FSDP, autocast caches a compute-dtype copy of every fp32 weight for the step. Under LoRA only the
    adapters have gradients, and the base, already in the compute dtype, gets no autocast copy."""
    a = plan.compute_dtype.itemsize
    lora = plan.lora
    if not plan.uses_fsdp:
        return CommBuffers(0.0, 0.0, 0.0 if a == 4 else state_bytes(plan, 0).params / FP32 * a)
    if fsdp_ranks(plan) == 1 and not plan.job.parallel.cpu_offload:
        return CommBuffers(0.0, 0.0, 0.0)  # HSDP/replicate only: nothing is gathered
    gathered = _unit_numels(plan, param_specs(plan.model))
    grads = gathered
    if lora:
        grads = _unit_numels(plan, adapter_specs(plan.model, lora))
        gathered = {k: n + grads.get(k, 0) for k, n in gathered.items()}

    def unit(k: str, grad_bytes: int) -> int:
        return a * gathered.get(k, 0) + grad_bytes * grads.get(k, 0)

    root = max((unit(k, a + FP32) for k in gathered if k.startswith("root")), default=0)
    layer = max((unit(k, a) for k in gathered if not k.startswith("root")), default=0)
    return CommBuffers(float(root), float(layer), 0.0)


def transient_bytes(
    plan, pad_values: bool | None = None, comm: CommBuffers | None = None, pp_rank: int = 0
) -> tuple[Activations, CommBuffers, float]:
    """(activations, communication buffers, peak of both together) on pipeline rank ``pp_rank``;
    ``comm``: the plan's ``comm_buffer_bytes`` when the caller has it already."""
    acts = activation_bytes(plan, pad_values, pp_rank)
    comm = comm or comm_buffer_bytes(plan)
    return acts, comm, max(acts.phases(comm.root, comm.layer)) + comm.autocast
