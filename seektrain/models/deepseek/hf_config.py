"""Translate between a Hugging Face ``config.json`` and our ``ModelConfig``.

Two dialects of config.json exist for the same models: the official DeepSeek releases (``rope_theta`` and
``rope_scaling`` at the top level, written for their remote code) and transformers 5 (``rope_parameters``
holding both). We read either and write the release dialect, which transformers 5, vLLM and the
official code all read. Fields we do not model (token ids, ``aux_loss_alpha``...) are kept in
``ModelConfig.extra`` so a load/save round trip does not lose them.
"""

from __future__ import annotations

import json
import os

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig, RopeScaling
from seektrain.models.hub import resolve_local_path

# architecture name in config.json -> (our arch, transformers model_type)
ARCH_BY_HF = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "LlamaForCausalLM": "llama",
}
HF_BY_ARCH = {arch: name for name, arch in ARCH_BY_HF.items()}

_COMMON = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MOE = (
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "moe_layer_freq",
    "scoring_func",
    "topk_method",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
)
# Fields we interpret (or deliberately drop) ourselves; everything else goes to ModelConfig.extra.
_CONSUMED = (
    set(_COMMON)
    | set(_MLA)
    | set(_MOE)
    | {
        "architectures",
        "model_type",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "attention_bias",
        "initializer_range",
        "q_lora_rank",
        "num_nextn_predict_layers",
        "num_experts",
        "hidden_act",
        "mlp_bias",
        "head_dim",
        "qk_head_dim",
        "rope_interleave",
        "quantization_config",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "auto_map",
        "pretraining_tp",
        "attention_dropout",
        "use_cache",
        "output_router_logits",
        "partial_rotary_factor",
    }
)
# Defaults of the official modelling code where a release omits a field.
_ARCH_DEFAULTS = {
    "deepseek_v2": dict(scoring_func="softmax", topk_method="greedy", norm_topk_prob=False),
    "deepseek_v3": dict(scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True),
}


class HFConfigError(UserError):
    """A config.json that cannot describe a model we build; the message is one line naming the field."""


def read_config_json(path: str | os.PathLike, what: str = "model.hf_path") -> dict:
    """Parse ``path/config.json`` (``path`` may be a hub id in the local cache), turning every failure
    into one readable line; ``what`` names the option ``path`` came from in those lines."""
    path = os.fspath(resolve_local_path(os.fspath(path), what))
    if not os.path.isdir(path):
        raise HFConfigError(
            f"{what}={path}: no such directory (expected a Hugging Face model folder or a "
            "cached hub id org/name)"
        )
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise HFConfigError(f"{file}: missing (a Hugging Face model folder needs a config.json)")
    try:
        with open(file, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFConfigError(f"{file}: unreadable JSON ({exc})") from None
    except RecursionError:
        raise HFConfigError(f"{file}: nests too deeply to be a model config") from None
    if not isinstance(raw, dict):
        raise HFConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def hf_arch(raw: dict, where: str = "config.json") -> str:
    """Our arch for a config dict, from ``architectures`` (or ``model_type`` when that is absent)."""
    names = raw.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in ARCH_BY_HF:
            return ARCH_BY_HF[name]
    if not names and raw.get("model_type") in HF_BY_ARCH:
        return raw["model_type"]
    found = ", ".join(map(str, names)) or f"model_type={raw.get('model_type')!r}"
    raise HFConfigError(f"{where}: unsupported architecture {found}; expected one of {', '.join(ARCH_BY_HF)}")


def _rope(raw: dict, where: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and YaRN settings from either dialect."""
    params: dict = raw["rope_parameters"] if isinstance(raw.get("rope_parameters"), dict) else {}
    scaling: dict = raw["rope_scaling"] if isinstance(raw.get("rope_scaling"), dict) else params
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise HFConfigError(f"{where}: rope scaling type {kind!r} is not supported (only 'yarn' is)")
    if scaling.get("truncate", True) is False:
        raise HFConfigError(f"{where}: YaRN with truncate=false is not supported")
    orig = int(scaling.get("original_max_position_embeddings", 4096))
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else raw.get("max_position_embeddings", orig) / orig
    rs = RopeScaling(
        type="yarn",
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
        mscale=float(scaling.get("mscale") or 1.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )
    if scaling.get("attention_factor") is not None:
        raise HFConfigError(f"{where}: rope attention_factor is not supported (give mscale/mscale_all_dim)")
    return float(theta), rs


def config_from_hf(raw: dict, name: str = "custom", where: str = "config.json") -> ModelConfig:
    """Build a validated ``ModelConfig`` from a config.json dict; errors are one line naming the field
    (a value of the wrong type, e.g. ``"hidden_size": "abc"``, included)."""
    try:
        return _config_from_hf(raw, name, where)
    except HFConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise HFConfigError(
            f"{where}: a field has a value of the wrong type or range ({exc}); fix config.json"
        ) from None


def _config_from_hf(raw: dict, name: str, where: str) -> ModelConfig:
    arch = hf_arch(raw, where)

    def need(key: str):
        if raw.get(key) is None:
            raise HFConfigError(f"{where}: missing field {key!r} (required for {HF_BY_ARCH[arch]})")
        return raw[key]

    def count(key: str, value):  # a width or a count: a JSON integer >= 1, not "64", 64.0, true or 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HFConfigError(f"{where}: {key}={value!r} must be an integer >= 1; fix config.json")
        return value

    if raw.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{where}: hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise HFConfigError(f"{where}: mlp_bias=true is not supported")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(f"{where}: partial_rotary_factor != 1 is not supported")
    theta, rope_scaling = _rope(raw, where)
    fields = {key: count(key, need(key)) for key in _COMMON}
    kv_heads = raw.get("num_key_value_heads")
    fields.update(
        name=name,
        arch=arch,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        num_key_value_heads=fields["num_attention_heads"]
        if kv_heads is None
        else count("num_key_value_heads", kv_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        initializer_range=float(raw.get("initializer_range", 0.02)),
    )
    if arch == "llama":
        head_dim = raw.get("head_dim")
        if head_dim is not None and head_dim != fields["hidden_size"] // fields["num_attention_heads"]:
            raise HFConfigError(
                f"{where}: head_dim={head_dim} != hidden_size/num_attention_heads is not supported"
            )
        if fields["attention_bias"]:
            # No DeepSeek release uses attention biases; the weight mapping carries none.
            raise HFConfigError(f"{where}: attention_bias=true is not supported for LlamaForCausalLM")
    else:
        if raw.get("rope_interleave", True) is False:
            raise HFConfigError(f"{where}: rope_interleave=false is not supported (MLA RoPE is interleaved)")
        fields.update({key: need(key) for key in _MLA})
        fields["q_lora_rank"] = raw.get("q_lora_rank")
        experts = raw.get("n_routed_experts", raw.get("num_experts")) or 0
        defaults = _ARCH_DEFAULTS[arch]
        fields.update(
            n_routed_experts=int(experts),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            scoring_func=raw.get("scoring_func") or defaults["scoring_func"],
            topk_method=raw.get("topk_method") or defaults["topk_method"],
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", defaults["norm_topk_prob"])),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        )
        if arch == "deepseek_v3":
            fields["num_nextn_predict_layers"] = int(raw.get("num_nextn_predict_layers") or 0)
    fields["extra"] = {k: v for k, v in raw.items() if k not in _CONSUMED}
    try:
        return ModelConfig(**fields).validate()
    except (TypeError, ValueError) as exc:
        raise HFConfigError(f"{where}: {exc}") from None


def quant_block_size(raw: dict) -> tuple[int, int]:
    """The FP8 block size of an official release (``quantization_config.weight_block_size``)."""
    quant = raw.get("quantization_config") or {}
    block = quant.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def config_to_hf(cfg: ModelConfig, dtype_name: str) -> dict:
    """config.json for ``cfg`` in the release dialect, with everything transformers 5 needs."""
    out: dict = {
        "architectures": [HF_BY_ARCH[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name,
    }
    if cfg.rope_scaling is not None and cfg.rope_scaling.factor > 1.0:
        rs = cfg.rope_scaling
        out["rope_scaling"] = {
            "type": rs.type,
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
        }
    if cfg.arch == "llama":
        out["mlp_bias"] = False
    else:
        first_dense = cfg.first_k_dense_replace if cfg.is_moe else cfg.num_hidden_layers
        out.update(
            {
                "q_lora_rank": cfg.q_lora_rank,
                "kv_lora_rank": cfg.kv_lora_rank,
                "qk_nope_head_dim": cfg.qk_nope_head_dim,
                "qk_rope_head_dim": cfg.qk_rope_head_dim,
                "v_head_dim": cfg.v_head_dim,
                "n_routed_experts": cfg.n_routed_experts,
                "n_shared_experts": cfg.n_shared_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "first_k_dense_replace": first_dense,
                "moe_layer_freq": cfg.moe_layer_freq,
                "scoring_func": cfg.scoring_func,
                "topk_method": cfg.topk_method,
                "n_group": cfg.n_group,
                "topk_group": cfg.topk_group,
                "norm_topk_prob": cfg.norm_topk_prob,
                "routed_scaling_factor": cfg.routed_scaling_factor,
            }
        )
        if cfg.arch == "deepseek_v3":
            out["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
            out["rope_interleave"] = True
    for key, value in cfg.extra.items():
        out.setdefault(key, value)
    return out
