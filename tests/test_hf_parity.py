"""Hugging Face interchange: logits parity with transformers in both directions, the official FP8 release
layout, sharding, and the sizes of the full presets (built on the meta device)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from seektrain.models import ModelConfig, RopeScaling, build_model, count_params, get_preset  # noqa: E402
from seektrain.models.deepseek.hf_io import from_pretrained, save_pretrained  # noqa: E402
from seektrain.models.deepseek.hf_weights import fp8_quantization_config, quantize_fp8  # noqa: E402
from seektrain.platform import policy_for  # noqa: E402

TOL = 1e-4
# transformers -> ours runs our model with the kernels CPU training uses (value-padded MLA attention,
# padded expert rows); ours -> transformers with the default ones
CPU_KERNELS = policy_for(torch.device("cpu")).model_kernels()
YARN = dict(
    type="yarn",
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=0.707,
)


def _randomize(model: torch.nn.Module, seed: int, include: Callable[[str], bool] = lambda name: True) -> None:
    """Weights large enough that routing and attention are far from uniform (ties would hide bugs);
    only the tensors whose names ``include`` accepts (e.g. a LoRA run's base or its adapters)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name or not include(name):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "e_score_correction_bias" in name:
                p.copy_(0.3 * noise)
            elif name.endswith("gate.weight"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _logits_diff(hf_model, ours, vocab: int, seed: int = 0) -> float:
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))
    hf_model.eval()
    with torch.no_grad():
        return (hf_model(tokens).logits.float() - ours(tokens).logits.float()).abs().max().item()


def _hf_to_ours(hf_cfg, tmp_path, seed=0):
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    _randomize(hf_model, seed)
    hf_model.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path, kernels=CPU_KERNELS)
    return hf_model, ours


def _v3_config(**kw):
    base = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_scaling=YARN,
    )
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def _v2_config(**kw):
    base = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        topk_method="greedy",
        norm_topk_prob=False,
        max_position_embeddings=256,
        rope_scaling=YARN,
    )
    base.update(kw)
    return transformers.DeepseekV2Config(**base)


# ------------------------------------------------------------------------- transformers -> ours
@pytest.mark.parametrize("kv_heads,tied", [(2, False), (4, True)], ids=["gqa", "mha-tied"])
def test_dense_llama_parity(tmp_path, kv_heads, tied):
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        rope_theta=5000.0,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    hf_model, ours = _hf_to_ours(cfg, tmp_path)
    assert ours.cfg.arch == "llama" and ours.cfg.num_key_value_heads == kv_heads
    assert ours.cfg.rope_theta == 5000.0 and ours.cfg.tie_word_embeddings is tied
    assert _logits_diff(hf_model, ours, 96) <= TOL


def test_v2_lite_style_parity(tmp_path):
    hf_model, ours = _hf_to_ours(_v2_config(), tmp_path)
    assert ours.cfg.q_lora_rank is None and ours.cfg.topk_method == "greedy"
    assert ours.cfg.rope_scaling.factor == 4.0 and ours.cfg.rope_scaling.mscale_all_dim == 0.707
    assert _logits_diff(hf_model, ours, 96) <= TOL


def test_v2_group_limited_greedy_parity(tmp_path):
    cfg = _v2_config(
        q_lora_rank=32,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
    )
    hf_model, ours = _hf_to_ours(cfg, tmp_path, seed=1)
    assert ours.cfg.topk_method == "group_limited_greedy" and ours.cfg.n_group == 4
    assert _logits_diff(hf_model, ours, 96) <= TOL


def test_v3_yarn_noaux_tc_parity(tmp_path):
    hf_model, ours = _hf_to_ours(_v3_config(), tmp_path, seed=2)
    cfg = ours.cfg
    assert (cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    assert cfg.num_nextn_predict_layers == 0  # transformers builds and saves no MTP layer
    bias = ours.layers["1"].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0 and bias.dtype == torch.float32
    assert _logits_diff(hf_model, ours, 96) <= TOL


def test_transformers_in_memory_fused_layout_loads(tmp_path):
    """transformers 5 keeps experts fused (mlp.experts.gate_up_proj); a raw dump of that must load too."""
    hf_model = transformers.AutoModelForCausalLM.from_config(_v3_config(), dtype=torch.float32)
    _randomize(hf_model, 3)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(hf_model.config.to_json_string())
    assert _logits_diff(hf_model, from_pretrained(tmp_path, kernels=CPU_KERNELS), 96) <= TOL


# ------------------------------------------------------------------------- ours -> transformers
def _ours(name: str, seed: int, **changes) -> torch.nn.Module:
    model = build_model(get_preset(name).replace(**changes), seed=seed)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(0.05 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(seed)))
    return model


_EXPORTS = {
    "tiny-dense": {},
    "tiny-v2": dict(
        rope_scaling=RopeScaling(
            factor=4.0, original_max_position_embeddings=512, mscale=0.707, mscale_all_dim=0.707
        )
    ),
    "tiny-v3": dict(
        rope_scaling=RopeScaling(
            factor=8.0, original_max_position_embeddings=256, mscale=1.0, mscale_all_dim=1.0
        )
    ),
}


@pytest.mark.parametrize("preset", list(_EXPORTS))
def test_export_roundtrip(tmp_path, preset):
    model = _ours(preset, seed=4, **_EXPORTS[preset])
    save_pretrained(model, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _logits_diff(hf_model, model, model.cfg.vocab_size) <= TOL
    back = from_pretrained(tmp_path)
    assert back.cfg.replace(name="x") == model.cfg.replace(name="x")
    mine, theirs = model.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def test_export_writes_release_layout_with_mtp_and_shards(tmp_path):
    model = _ours("tiny-v3", seed=5)
    files = save_pretrained(model, tmp_path, dtype=torch.bfloat16, max_shard_bytes=200_000)
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert config["torch_dtype"] == "bfloat16" and config["num_nextn_predict_layers"] == 1
    n = model.cfg.num_hidden_layers
    keys = index["weight_map"]
    for key in (
        "model.layers.1.mlp.experts.7.up_proj.weight",
        f"model.layers.{n}.enorm.weight",
        f"model.layers.{n}.eh_proj.weight",
        f"model.layers.{n}.shared_head.norm.weight",
        f"model.layers.{n}.shared_head.head.weight",
        f"model.layers.{n}.embed_tokens.weight",
        f"model.layers.{n}.mlp.experts.0.down_proj.weight",
        f"model.layers.{n}.self_attn.q_a_proj.weight",
    ):
        assert key in keys, key
    with safe_open(tmp_path / keys["model.layers.1.mlp.gate.e_score_correction_bias"], "pt") as fh:
        assert fh.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    back = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert back.cfg.num_nextn_predict_layers == 1
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value.to(back.state_dict()[key].dtype)), key
    # transformers ignores the MTP layer (it builds none) and still matches the main model
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _logits_diff(hf_model, from_pretrained(tmp_path), model.cfg.vocab_size) <= TOL


# ------------------------------------------------------------------------- official FP8 release layout
def test_official_fp8_layout_dequantises(tmp_path):
    cfg = ModelConfig(
        name="fp8",
        arch="deepseek_v3",
        vocab_size=320,
        hidden_size=160,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=144,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        first_k_dense_replace=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    )
    original = build_model(cfg, seed=6)
    src = tmp_path / "bf16"
    save_pretrained(original, src)
    # Rewrite as the release does: every projection inside the layers in e4m3 + per-block scale_inv.
    quantized, scales = {}, {}
    with safe_open(src / "model.safetensors", "pt") as fh:
        for key in fh.keys():
            t = fh.get_tensor(key)
            if key.startswith("model.layers.") and key.endswith("proj.weight"):
                quantized[key], scales[key] = quantize_fp8(t)
                quantized[key + "_scale_inv"] = scales[key]
            else:
                quantized[key] = t
    assert any(t.shape[0] % 128 and t.shape[1] % 128 for k, t in quantized.items() if k in scales)
    keys = sorted(quantized)
    half = len(keys) // 2
    dst = tmp_path / "fp8"
    dst.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": keys[:half],
        "model-00002-of-00002.safetensors": keys[half:],
    }
    for name, names in shards.items():
        save_file({k: quantized[k] for k in names}, dst / name, metadata={"format": "pt"})
    weight_map = {k: name for name, names in shards.items() for k in names}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config()
    (dst / "config.json").write_text(json.dumps(config))

    loaded = from_pretrained(dst)
    assert loaded.cfg.num_nextn_predict_layers == 1 and "quantization_config" not in loaded.cfg.extra
    got = dict(loaded.named_parameters())
    ref = dict(original.named_parameters())
    n_checked = 0
    for key, scale in scales.items():
        rows, cols = quantized[key].shape
        full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        exact = quantized[key].float() * full
        m = re.match(r"model\.layers\.(\d+)\.(.*?)(mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight)?$", key)
        layer, rest = int(m.group(1)), m.group(2)
        prefix = f"layers.{layer}." if layer < cfg.num_hidden_layers else "mtp.0.block."
        if key.endswith("eh_proj.weight"):
            ours, theirs = got["mtp.0.eh_proj.weight"], ref["mtp.0.eh_proj.weight"]
        elif m.group(3):
            e, kind = int(m.group(4)), m.group(5)
            pname = (
                prefix + rest + ("mlp.experts.down_proj" if kind == "down" else "mlp.experts.gate_up_proj")
            )
            ours, theirs = got[pname][e], ref[pname][e]
            if kind != "down":
                sl = slice(0, rows) if kind == "gate" else slice(rows, 2 * rows)
                ours, theirs = ours[sl], theirs[sl]
        else:
            ours, theirs = got[prefix + rest], ref[prefix + rest]
        assert torch.equal(ours, exact), key
        # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormals: absolute <= scale * 2^-10
        assert ((ours - theirs).abs() <= theirs.abs() / 16 + full / 1024 + 1e-12).all(), key
        n_checked += 1
    assert n_checked == len(scales)
    for name in (
        "mtp.0.enorm.weight",
        "mtp.0.hnorm.weight",
        "mtp.0.norm.weight",
        "mtp.0.block.mlp.gate.weight",
        "embed_tokens.weight",
        "lm_head.weight",
    ):
        assert torch.equal(got[name], ref[name]), name


# ------------------------------------------------------------------------- full-size presets, no memory
# preset, published total, published active, tolerances
_SIZES = [
    ("deepseek-v3", 671.0e9, 37e9, 0.5e9, 1e9),
    ("deepseek-v2", 236e9, 21e9, 0.5e9, 0.5e9),
    ("deepseek-v2-lite", 15.7e9, 2.4e9, 0.1e9, 0.1e9),
    ("deepseek-llm-7b", 6.9e9, None, 0.05e9, None),
    ("deepseek-llm-67b", 67.4e9, None, 0.1e9, None),
]


def test_every_official_preset_has_a_size_check():
    from seektrain.models import OFFICIAL_PRESETS

    assert set(OFFICIAL_PRESETS) == {row[0] for row in _SIZES}


@pytest.mark.parametrize("preset,total,active,tol_total,tol_active", _SIZES)
def test_full_presets_on_meta(preset, total, active, tol_total, tol_active):
    cfg = get_preset(preset)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    counts = count_params(cfg)
    assert abs(counts.total - total) <= tol_total, counts
    if active is not None:
        assert abs(counts.active - active) <= tol_active, counts
    if preset == "deepseek-v3":
        assert counts.mtp > 0


# ------------------------------------------------------------------------- config.json mapping
# The config.json of the official DeepSeek-V3 release (auto_map trimmed).
_V3_RELEASE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_official_v3_config_matches_preset():
    from seektrain.models.deepseek.hf_config import config_from_hf

    cfg = config_from_hf(_V3_RELEASE, name="deepseek-v3")
    assert cfg.replace(extra={}) == get_preset("deepseek-v3")
    assert cfg.extra == {
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "seq_aux": True,
    }


@pytest.mark.parametrize(
    "preset", ["deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "deepseek-llm-67b", "tiny-dense", "tiny-v2"]
)
def test_config_roundtrip_and_transformers_reads_it(preset):
    from seektrain.models.deepseek.hf_config import config_from_hf, config_to_hf

    cfg = get_preset(preset)
    raw = config_to_hf(cfg, "bfloat16")
    assert config_from_hf(json.loads(json.dumps(raw)), name=preset) == cfg
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    assert hf_cfg.num_hidden_layers == cfg.num_hidden_layers
    if cfg.rope_scaling is not None:
        assert hf_cfg.rope_parameters["rope_type"] == "yarn"
        assert hf_cfg.rope_parameters["factor"] == cfg.rope_scaling.factor
