"""The shape description (models/deepseek/shapes.py) is the model: every linear, routed-expert weight, embedding,
router and norm of each preset built on the meta device is described with its real shapes, and nothing
else is described. The TP plan, memory planner, FP8 conversion, FLOP count and layout checks read the
description, so a projection added to a module but not described fails here first."""

from __future__ import annotations

import pytest
from torch import nn

from seektrain.models.deepseek.moe import GroupedExperts, Router
from seektrain.models.deepseek.presets import PRESETS, get_preset
from seektrain.models.deepseek.shapes import (
    EMBEDDING,
    EXPERTS,
    LINEAR,
    NORM,
    ROUTER,
    TP_STYLES,
    model_weights,
    weights_by_path,
)
from seektrain.models.layers import RMSNorm
from seektrain.models.registry import build_model
from seektrain.plan import memory

# every preset, and the switches the presets leave at one value
VARIANTS = {name: get_preset(name) for name in PRESETS} | {
    "tiny-dense+bias+tied": get_preset("tiny-dense").replace(attention_bias=True, tie_word_embeddings=True),
    "tiny-v3+bias": get_preset("tiny-v3").replace(attention_bias=True),
    "tiny-v3-no-q-lora-no-shared": get_preset("tiny-v3").replace(q_lora_rank=None, n_shared_experts=0),
    "tiny-v2-every-other-moe": get_preset("tiny-v2").replace(moe_layer_freq=2, first_k_dense_replace=0),
}
KINDS = {LINEAR: nn.Linear, NORM: RMSNorm, ROUTER: Router, EMBEDDING: nn.Embedding}


def _leaf_shapes(model: nn.Module) -> dict[str, tuple]:
    """(kind, in, out, bias, experts) of every weight-holding leaf of a built model, by path."""
    found = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            found[name] = (LINEAR, module.in_features, module.out_features, module.bias is not None, 0)
        elif isinstance(module, GroupedExperts):
            e, two_f, d = module.gate_up_proj.shape
            found[f"{name}.gate_up_proj"] = (EXPERTS, d, two_f, False, e)
            found[f"{name}.down_proj"] = (
                EXPERTS,
                module.down_proj.shape[2],
                module.down_proj.shape[1],
                False,
                e,
            )
        elif isinstance(module, Router):
            found[name] = (ROUTER, module.weight.shape[1], module.weight.shape[0], False, 0)
        elif isinstance(module, RMSNorm):
            found[name] = (NORM, module.weight.shape[0], module.weight.shape[0], False, 0)
        elif isinstance(module, nn.Embedding):
            found[name] = (EMBEDDING, module.num_embeddings, module.embedding_dim, False, 0)
        else:
            assert not list(module.parameters(recurse=False)), (
                f"{name}: a {type(module).__name__} holds weights"
            )
    return found


@pytest.mark.parametrize("name", list(VARIANTS))
def test_description_is_the_built_model(name):
    cfg = VARIANTS[name]
    model = build_model(cfg, device="meta")
    described = {
        w.path: (w.kind, w.in_features, w.out_features, w.bias, w.experts) for w in model_weights(cfg)
    }
    built = _leaf_shapes(model)
    assert sorted(set(built) - set(described)) == [], "modules the shape description does not describe"
    assert sorted(set(described) - set(built)) == [], "described weights the model does not build"
    assert {p: described[p] for p in built if described[p] != built[p]} == {}, "wrong shapes"
    for w in model_weights(cfg):
        assert w.tp in TP_STYLES, w.path
        if w.kind in KINDS:
            assert isinstance(model.get_submodule(w.path), KINDS[w.kind]), w.path
    # every parameter, with its shape, is one the description lists (the memory planner's state count)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {s.name: s.shape for s in memory.param_specs(cfg)} == params


def test_dtype_policy_follows_deepseek_v3():
    """FP8 training keeps the embedding, norms, router, output head and MTP's eh_proj in high precision
    (DeepSeek-V3 sec. 3.3.1); every other linear and the routed experts are FP8-convertible."""
    kept = {w.pattern: w.high_precision for w in model_weights(get_preset("tiny-v3")) if w.high_precision}
    assert {p for p, why in kept.items() if why != "norm"} == {
        "embed_tokens",
        "layers.*.mlp.gate",
        "mtp.*.block.mlp.gate",
        "lm_head",
        "mtp.*.eh_proj",
    }
    assert kept["lm_head"] == "output head" and kept["mtp.*.eh_proj"] == "MTP projection"
    assert {w.kind for w in model_weights(get_preset("tiny-v3")) if w.high_precision == "norm"} == {NORM}


def test_patterns_and_tp_styles_of_deepseek_v3():
    weights = weights_by_path(get_preset("deepseek-v3"))
    styles = {w.pattern: w.tp for w in weights.values() if w.kind != NORM}
    assert styles == {
        "embed_tokens": "vocab-embedding",
        "lm_head": "vocab-head",
        "mtp.*.eh_proj": "sequence",
        "layers.*.self_attn.q_a_proj": "replicated",
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "replicated",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.gate": "replicated",
        "layers.*.mlp.experts.gate_up_proj": "expert",
        "layers.*.mlp.experts.down_proj": "expert",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise-partial",
        **{
            f"mtp.*.block.{p.split('.', 2)[2]}": s
            for p, s in [
                ("layers.*.self_attn.q_a_proj", "replicated"),
                ("layers.*.self_attn.q_b_proj", "colwise"),
                ("layers.*.self_attn.kv_a_proj_with_mqa", "replicated"),
                ("layers.*.self_attn.kv_b_proj", "colwise"),
                ("layers.*.self_attn.o_proj", "rowwise"),
                ("layers.*.mlp.gate", "replicated"),
                ("layers.*.mlp.experts.gate_up_proj", "expert"),
                ("layers.*.mlp.experts.down_proj", "expert"),
                ("layers.*.mlp.shared_experts.gate_proj", "colwise"),
                ("layers.*.mlp.shared_experts.up_proj", "colwise"),
                ("layers.*.mlp.shared_experts.down_proj", "rowwise-partial"),
            ]
        },
    }
    experts = weights["layers.3.mlp.experts.gate_up_proj"]
    assert (experts.experts, experts.active, experts.in_features, experts.out_features) == (
        256,
        8,
        7168,
        4096,
    )
