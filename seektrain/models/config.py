"""One dataclass describes every model of the DeepSeek family.

Field names follow the Hugging Face ``config.json`` of the official releases so that a config converts
in both directions without a renaming table: dense DeepSeek-LLM (Llama architecture), DeepSeek-V2
(MLA + DeepSeekMoE with softmax routing) and DeepSeek-V3 (MLA + sigmoid routing with a bias for
balancing, group-limited selection, multi-token prediction).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from seektrain.errors import UserError

ARCHITECTURES = ("llama", "deepseek_v2", "deepseek_v3")
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass
class RopeScaling:
    """YaRN context extension (the only scaling the DeepSeek releases use)."""

    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass
class ModelConfig:
    name: str = "custom"
    arch: str = "deepseek_v3"
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 30
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    # Multi-head latent attention; kv_lora_rank None means ordinary MHA/GQA.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # DeepSeekMoE; n_routed_experts 0 means every layer is a dense SwiGLU MLP.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # Multi-token prediction modules (V3); not counted in the published total size.
    num_nextn_predict_layers: int = 0
    extra: dict = field(default_factory=dict)

    # ----------------------------------------------------------------- derived facts
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        """The head size of the values: MLA's ``v_head_dim``; elsewhere ``v_head_dim`` is an unused default
        and values have the ordinary head size."""
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.is_moe and layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0
        )

    def validate(self) -> ModelConfig:
        """Raise ValueError naming the first inconsistent field and how to fix it."""

        def bad(msg: str) -> None:
            raise UserError(f"model config {self.name!r}: {msg}")

        if self.arch not in ARCHITECTURES:
            bad(f"arch={self.arch!r} is not one of {ARCHITECTURES}")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, key) <= 0:
                bad(f"{key} must be positive, got {getattr(self, key)}")
        if not self.is_mla:
            if self.hidden_size % self.num_attention_heads:
                bad("hidden_size must be divisible by num_attention_heads")
            if self.num_attention_heads % self.num_key_value_heads:
                bad("num_attention_heads must be divisible by num_key_value_heads (GQA groups)")
        if self.rope_dim % 2:
            bad("the rotary dimension must be even")
        if self.is_moe:
            if self.scoring_func not in SCORING_FUNCS:
                bad(f"scoring_func={self.scoring_func!r} is not one of {SCORING_FUNCS}")
            if self.topk_method not in TOPK_METHODS:
                bad(f"topk_method={self.topk_method!r} is not one of {TOPK_METHODS}")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                bad("num_experts_per_tok must be in 1..n_routed_experts")
            if self.n_routed_experts % self.n_group:
                bad("n_routed_experts must be divisible by n_group")
            if not 0 < self.topk_group <= self.n_group:
                bad("topk_group must be in 1..n_group")
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size must be positive for a MoE model")
        if self.num_nextn_predict_layers and self.arch != "deepseek_v3":
            bad("multi-token prediction (num_nextn_predict_layers) exists only for deepseek_v3")
        return self

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UserError(f"model config: unknown fields {sorted(unknown)}")
        _check_types(cls, data, "model config")
        data = dict(data)
        if data.get("rope_scaling") is not None:
            if not isinstance(data["rope_scaling"], dict):
                raise UserError("model config: rope_scaling must be an object or null")
            _check_types(RopeScaling, data["rope_scaling"], "model config: rope_scaling")
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data).validate()


def _check_types(cls, data: dict, where: str) -> None:
    """Each JSON value has its field's type (an int field holds an int, a float a finite number...), so
    a hand-edited model_config.json fails here naming the field, not deep inside the model."""
    import math
    import typing

    allowed = {int: (int,), float: (int, float), str: (str,), bool: (bool,), dict: (dict,)}
    for name, hint in typing.get_type_hints(cls).items():
        if name not in data:
            continue
        value, args = data[name], typing.get_args(hint)
        if value is None and type(None) in args:
            continue
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        if base not in allowed:
            continue
        ok = isinstance(value, allowed[base]) and (base is bool or not isinstance(value, bool))
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = False
        if not ok:
            raise UserError(f"{where}: field {name!r} must be {base.__name__}, got {value!r}")
