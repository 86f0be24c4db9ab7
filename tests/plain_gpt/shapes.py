"""Every weight of the plain GPT with its TP style (the styles of ``seektrain.models``): attention and MLP
split Megatron-style (q/k/v and up column-wise by head / feature, o and down row-wise), token and position
tables and the head vocabulary- (position-) sharded, LayerNorms sequence-parallel."""

from __future__ import annotations

from plain_gpt.config import GPTConfig
from seektrain.models import (
    COLWISE,
    EMBEDDING,
    LINEAR,
    NORM,
    ROWWISE,
    SEQUENCE,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    Weight,
)


def _norm(path: str, d: int, **where) -> Weight:
    return Weight(path, NORM, d, d, SEQUENCE, bias=True, high_precision="norm", **where)


def _layer(cfg: GPTConfig, i: int) -> list[Weight]:
    d, ff, p = cfg.hidden_size, cfg.intermediate_size, f"layers.{i}."
    heads, feats, where = (
        ("num_attention_heads", cfg.num_attention_heads),
        ("intermediate_size", ff),
        {"layer": i, "block": i},
    )
    return [
        _norm(f"{p}input_layernorm", d, **where),
        *(Weight(f"{p}self_attn.{n}_proj", LINEAR, d, d, COLWISE, heads, True, **where) for n in "qkv"),
        Weight(f"{p}self_attn.o_proj", LINEAR, d, d, ROWWISE, heads, True, **where),
        _norm(f"{p}post_attention_layernorm", d, **where),
        Weight(f"{p}mlp.up_proj", LINEAR, d, ff, COLWISE, feats, True, **where),
        Weight(f"{p}mlp.down_proj", LINEAR, ff, d, ROWWISE, feats, True, **where),
    ]


def gpt_weights(cfg: GPTConfig) -> dict[str, Weight]:
    d, vocab = cfg.hidden_size, ("vocab_size", cfg.vocab_size)
    positions = ("max_position_embeddings", cfg.max_position_embeddings)
    out = [
        Weight(
            "embed_tokens", EMBEDDING, cfg.vocab_size, d, VOCAB_EMBEDDING, vocab, high_precision="embedding"
        ),
        Weight(
            "embed_positions",
            EMBEDDING,
            cfg.max_position_embeddings,
            d,
            VOCAB_EMBEDDING,
            positions,
            high_precision="embedding",
        ),
    ]
    for i in range(cfg.num_hidden_layers):
        out += _layer(cfg, i)
    out += [
        _norm("norm", d),
        Weight("lm_head", LINEAR, d, cfg.vocab_size, VOCAB_HEAD, vocab, high_precision="output head"),
    ]
    return {w.path: w for w in out}
