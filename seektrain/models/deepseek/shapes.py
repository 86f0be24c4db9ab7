"""One description of a DeepSeek model's weights, computed from its ``ModelConfig`` alone (nothing is built).

Every parameter-holding leaf of ``models/deepseek/transformer.py`` is one ``Weight``: each linear, the routed experts'
two fused weights, the embedding, the router and the norms. For each it records the shape, how tensor
parallelism places it (``tp``), which config quantity that split must divide (``tp_unit``), whether it is
expert-grouped, and its dtype policy (``high_precision``: why FP8 training keeps it in bf16). The TP plan
(``parallel/tensor_parallel.py``), the memory planner (``plan/memory.py``), FP8 conversion
(``parallel/float8.py``), FLOP counting (``observe/flops.py``) and the layout checks
(``plan/layout_checks.py``) all read it, so a new projection is described here once;
``tests/test_model_shapes.py`` fails when a module of a built model is missing here (or the reverse).

TP styles (``seq`` is the sequence-sharded layout under sequence parallelism, else replicated):

- ``colwise``: output features sharded (weight and bias dim 0); runs on the all-gathered input.
- ``rowwise``: input features sharded (weight dim 1); output reduce-scattered back to ``seq``.
- ``rowwise-partial``: as ``rowwise``, output left a partial sum that the enclosing block reduces
  (the shared experts, added to the routed experts' partial output).
- ``replicated``: whole weight on every rank, runs on the all-gathered input (MLA's low-rank
  projections and their norms, the router).
- ``sequence``: whole weight on every rank, runs on ``seq`` shards (``SequenceParallel``: the norms,
  MTP's ``eh_proj``).
- ``vocab-embedding``: the embedding, vocabulary-sharded (dim 0), output reduce-scattered to ``seq``.
- ``vocab-head``: the output head, vocabulary-sharded (dim 0), logits left sharded for ``loss_parallel``.
- ``expert``: routed-expert weights ``[E, out, in]``, split by expert (dim 0) under TP and EP.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from seektrain.models.config import ModelConfig

COLWISE, ROWWISE, ROWWISE_PARTIAL = "colwise", "rowwise", "rowwise-partial"
REPLICATED, SEQUENCE = "replicated", "sequence"
VOCAB_EMBEDDING, VOCAB_HEAD, EXPERT = "vocab-embedding", "vocab-head", "expert"
TP_STYLES = (COLWISE, ROWWISE, ROWWISE_PARTIAL, REPLICATED, SEQUENCE, VOCAB_EMBEDDING, VOCAB_HEAD, EXPERT)

LINEAR, EXPERTS, EMBEDDING, ROUTER, NORM = "linear", "experts", "embedding", "router", "norm"

# Pipeline stages: which top-level parts only the first or only the last stage keeps
# (seektrain/parallel/pipeline.py); everything else lives in the decoder layers ``layers.<i>``.
FIRST_STAGE = ("embed_tokens",)
LAST_STAGE = ("norm", "lm_head", "mtp")


@dataclass(frozen=True)
class Weight:
    """One weight of the model. ``path`` is the module path (``layers.3.self_attn.q_b_proj``) or, for
    the routed experts, the parameter path (``layers.3.mlp.experts.gate_up_proj``)."""

    path: str
    kind: str  # LINEAR | EXPERTS | EMBEDDING | ROUTER | NORM
    in_features: int  # EMBEDDING: the vocabulary; NORM: its width
    out_features: int
    tp: str  # one of TP_STYLES
    tp_unit: tuple[str, int] | None = None  # what the TP split cuts into whole pieces (name, count)
    bias: bool = False
    experts: int = 0  # EXPERTS: how many experts the weight groups (its dim 0)
    active: int = 1  # EXPERTS: how many of them one token runs
    high_precision: str | None = None  # why FP8 training keeps it in bf16; None: FP8-convertible
    layer: int | None = None  # decoder layer index (``layers.<i>``), None elsewhere (MTP included)
    block: int | None = None  # the config's layer index of the enclosing block (MTP depth k: L + k)
    tied_to: str | None = None  # the weight whose parameter this one shares (tied embeddings)

    @property
    def pattern(self) -> str:
        """The path with its layer or MTP index replaced by ``*`` (``layers.*.mlp.experts.gate_up_proj``)."""
        return re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", self.path)

    @property
    def part(self) -> str:
        """Where a pipeline keeps it: ``embed`` (first stage), ``head`` (last stage) or ``layer``."""
        top = self.path.split(".", 1)[0]
        return "embed" if top in FIRST_STAGE else "head" if top in LAST_STAGE else "layer"

    @property
    def weight_name(self) -> str:
        return self.path if self.kind == EXPERTS else f"{self.path}.weight"

    @property
    def weight_shape(self) -> tuple[int, ...]:
        if self.kind == NORM:
            return (self.in_features,)
        if self.kind == EMBEDDING:
            return (self.in_features, self.out_features)
        if self.kind == EXPERTS:
            return (self.experts, self.out_features, self.in_features)
        return (self.out_features, self.in_features)

    @property
    def matmul_params(self) -> int:
        """Weights one token multiplies with here (a lookup or a norm multiplies with none)."""
        if self.kind in (EMBEDDING, NORM):
            return 0
        return self.in_features * self.out_features * (self.active if self.kind == EXPERTS else 1)

    def params(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(parameter name, shape, dimension TP shards or None) of each parameter of this weight."""
        weight_dim = {
            COLWISE: 0,
            ROWWISE: 1,
            ROWWISE_PARTIAL: 1,
            VOCAB_EMBEDDING: 0,
            VOCAB_HEAD: 0,
            EXPERT: 0,
        }.get(self.tp)
        out = [] if self.tied_to else [(self.weight_name, self.weight_shape, weight_dim)]
        if self.bias:
            out.append((f"{self.path}.bias", (self.out_features,), 0 if self.tp == COLWISE else None))
        return out


def _linear(path: str, n_in: int, n_out: int, tp: str, unit=None, bias=False, why=None, **where) -> Weight:
    return Weight(path, LINEAR, n_in, n_out, tp, unit, bias, high_precision=why, **where)


def _norm(path: str, width: int, tp: str = SEQUENCE, **where) -> Weight:
    return Weight(path, NORM, width, width, tp, high_precision="norm", **where)


def _attention(cfg: ModelConfig, p: str, where: dict) -> list[Weight]:
    d, h, b = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    heads = ("num_attention_heads", h)
    if not cfg.is_mla:
        hd, kv = cfg.head_dim, cfg.num_key_value_heads
        kv_heads = ("num_key_value_heads", kv)
        return [
            _linear(f"{p}q_proj", d, h * hd, COLWISE, heads, b, **where),
            _linear(f"{p}k_proj", d, kv * hd, COLWISE, kv_heads, b, **where),
            _linear(f"{p}v_proj", d, kv * hd, COLWISE, kv_heads, b, **where),
            _linear(f"{p}o_proj", h * hd, d, ROWWISE, heads, b, **where),
        ]
    qk, rank = cfg.qk_head_dim, cfg.kv_lora_rank
    assert rank is not None  # an MLA config (cfg.is_mla)
    if cfg.q_lora_rank is None:
        out = [_linear(f"{p}q_proj", d, h * qk, COLWISE, heads, **where)]
    else:
        out = [
            _linear(f"{p}q_a_proj", d, cfg.q_lora_rank, REPLICATED, bias=b, **where),
            _norm(f"{p}q_a_layernorm", cfg.q_lora_rank, REPLICATED, **where),
            _linear(f"{p}q_b_proj", cfg.q_lora_rank, h * qk, COLWISE, heads, **where),
        ]
    return out + [
        _linear(f"{p}kv_a_proj_with_mqa", d, rank + cfg.qk_rope_head_dim, REPLICATED, bias=b, **where),
        _norm(f"{p}kv_a_layernorm", rank, REPLICATED, **where),
        _linear(f"{p}kv_b_proj", rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), COLWISE, heads, **where),
        _linear(f"{p}o_proj", h * cfg.v_head_dim, d, ROWWISE, heads, b, **where),
    ]


def _swiglu(p: str, d: int, hidden: int, unit: tuple[str, int], down: str, where: dict) -> list[Weight]:
    return [
        _linear(f"{p}gate_proj", d, hidden, COLWISE, unit, **where),
        _linear(f"{p}up_proj", d, hidden, COLWISE, unit, **where),
        _linear(f"{p}down_proj", hidden, d, down, unit, **where),
    ]


def _mlp(cfg: ModelConfig, p: str, block: int, where: dict) -> list[Weight]:
    d = cfg.hidden_size
    if not cfg.is_moe_layer(block):
        return _swiglu(
            p, d, cfg.intermediate_size, ("intermediate_size", cfg.intermediate_size), ROWWISE, where
        )
    f, e = cfg.moe_intermediate_size, cfg.n_routed_experts
    experts = ("n_routed_experts", e)
    out = [
        Weight(f"{p}gate", ROUTER, d, e, REPLICATED, high_precision="router", **where),
        Weight(
            f"{p}experts.gate_up_proj",
            EXPERTS,
            d,
            2 * f,
            EXPERT,
            experts,
            experts=e,
            active=cfg.num_experts_per_tok,
            **where,
        ),
        Weight(
            f"{p}experts.down_proj",
            EXPERTS,
            f,
            d,
            EXPERT,
            experts,
            experts=e,
            active=cfg.num_experts_per_tok,
            **where,
        ),
    ]
    if cfg.n_shared_experts:
        shared = f * cfg.n_shared_experts
        out += _swiglu(
            f"{p}shared_experts.",
            d,
            shared,
            ("moe_intermediate_size × n_shared_experts", shared),
            ROWWISE_PARTIAL,
            where,
        )
    return out


def block_weights(cfg: ModelConfig, block: int, prefix: str, layer: int | None = None) -> list[Weight]:
    """The weights of one decoder block (config layer index ``block``), paths under ``prefix``."""
    where: dict[str, Any] = {"layer": layer, "block": block}  # Weight.layer, Weight.block
    d = cfg.hidden_size
    return (
        [_norm(f"{prefix}input_layernorm", d, **where)]
        + _attention(cfg, f"{prefix}self_attn.", where)
        + [_norm(f"{prefix}post_attention_layernorm", d, **where)]
        + _mlp(cfg, f"{prefix}mlp.", block, where)
    )


def layer_weights(cfg: ModelConfig, layer: int) -> list[Weight]:
    """The weights of decoder layer ``layer`` (``layers.<layer>.…``)."""
    return block_weights(cfg, layer, f"layers.{layer}.", layer)


def mtp_weights(cfg: ModelConfig, depth: int) -> list[Weight]:
    """The weights of MTP module ``depth`` (``mtp.<depth>.…``); its block counts as layer L + depth."""
    d, p = cfg.hidden_size, f"mtp.{depth}."
    block = cfg.num_hidden_layers + depth
    return (
        [
            _norm(f"{p}enorm", d),
            _norm(f"{p}hnorm", d),
            _linear(f"{p}eh_proj", 2 * d, d, SEQUENCE, why="MTP projection"),
        ]
        + block_weights(cfg, block, f"{p}block.")
        + [_norm(f"{p}norm", d)]
    )


def _model_weights(cfg: ModelConfig) -> tuple[Weight, ...]:
    d, v, vocab = cfg.hidden_size, cfg.vocab_size, ("vocab_size", cfg.vocab_size)
    out = [Weight("embed_tokens", EMBEDDING, v, d, VOCAB_EMBEDDING, vocab, high_precision="embedding")]
    for i in range(cfg.num_hidden_layers):
        out += layer_weights(cfg, i)
    out += [
        _norm("norm", d),
        Weight(
            "lm_head",
            LINEAR,
            d,
            v,
            VOCAB_HEAD,
            vocab,
            high_precision="output head",
            tied_to="embed_tokens" if cfg.tie_word_embeddings else None,
        ),
    ]
    for k in range(cfg.num_nextn_predict_layers):
        out += mtp_weights(cfg, k)
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _cached(cfg_json: str) -> dict[str, Weight]:
    return {w.path: w for w in _model_weights(ModelConfig.from_dict(json.loads(cfg_json)))}


def weights_by_path(cfg: ModelConfig) -> dict[str, Weight]:
    """Every weight of the model ``build_model(cfg)`` builds, MTP modules included, by path, in module
    order (cached per config: the planner asks about the same few models thousands of times; do not
    modify the dict)."""
    return _cached(json.dumps(cfg.to_dict(), sort_keys=True))


def model_weights(cfg: ModelConfig) -> tuple[Weight, ...]:
    return tuple(weights_by_path(cfg).values())
