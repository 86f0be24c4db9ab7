"""Named model presets: the official releases (hyper-parameters from their config.json) and debug sizes.

``get_preset(name)`` returns a fresh, validated ``ModelConfig``; ``PRESETS`` lists the names.
"""

from __future__ import annotations

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig, RopeScaling


def _yarn(mscale: float) -> RopeScaling:
    # All DeepSeek-V2/V3 releases extend a 4K pre-training context 40x with YaRN.
    return RopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


def _deepseek_llm_7b() -> ModelConfig:
    return ModelConfig(
        name="deepseek-llm-7b",
        arch="llama",
        vocab_size=102400,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=30,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )


def _deepseek_llm_67b() -> ModelConfig:
    return ModelConfig(
        name="deepseek-llm-67b",
        arch="llama",
        vocab_size=102400,
        hidden_size=8192,
        intermediate_size=22016,
        num_hidden_layers=95,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )


def _deepseek_v2_lite() -> ModelConfig:
    return ModelConfig(
        name="deepseek-v2-lite",
        arch="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=163840,
        rope_scaling=_yarn(0.707),
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        first_k_dense_replace=1,
        scoring_func="softmax",
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )


def _deepseek_v2() -> ModelConfig:
    return ModelConfig(
        name="deepseek-v2",
        arch="deepseek_v2",
        vocab_size=102400,
        hidden_size=5120,
        intermediate_size=12288,
        num_hidden_layers=60,
        num_attention_heads=128,
        num_key_value_heads=128,
        max_position_embeddings=163840,
        rope_scaling=_yarn(0.707),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=160,
        n_shared_experts=2,
        num_experts_per_tok=6,
        moe_intermediate_size=1536,
        first_k_dense_replace=1,
        scoring_func="softmax",
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
    )


def _deepseek_v3() -> ModelConfig:
    return ModelConfig(
        name="deepseek-v3",
        arch="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        max_position_embeddings=163840,
        rope_scaling=_yarn(1.0),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        first_k_dense_replace=3,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    )


# Debug sizes: vocab 320 holds the byte-level tokenizer (256 bytes + specials) with room to spare and is
# a multiple of 64, so it divides evenly for tensor parallelism.
def _tiny_dense() -> ModelConfig:
    return ModelConfig(
        name="tiny-dense",
        arch="llama",
        vocab_size=320,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )


def _tiny_v2() -> ModelConfig:
    return ModelConfig(
        name="tiny-v2",
        arch="deepseek_v2",
        vocab_size=320,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        scoring_func="softmax",
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.0,
    )


def _tiny_v3() -> ModelConfig:
    return ModelConfig(
        name="tiny-v3",
        arch="deepseek_v3",
        vocab_size=320,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    )


def _small_v3() -> ModelConfig:
    # ~100M total parameters: the benchmark model, big enough that matmuls dominate.
    return ModelConfig(
        name="small-v3",
        arch="deepseek_v3",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        first_k_dense_replace=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    )


def _small_v3_sparse() -> ModelConfig:
    # small-v3's width with DeepSeek-V3's routing shape: 128 fine-grained experts (a quarter of the width,
    # as V3's 2048 of 7168), top-8 from 4 of 8 groups. 5x more total than active parameters (small-v3:
    # 3x; V3: 18x): the benchmark model for engines whose cost grows with total parameters.
    return _small_v3().replace(
        name="small-v3-sparse",
        n_routed_experts=128,
        moe_intermediate_size=128,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
    )


BUILDERS = {  # the family's presets for the registry (models/registry.py)
    "deepseek-llm-7b": _deepseek_llm_7b,
    "deepseek-llm-67b": _deepseek_llm_67b,
    "deepseek-v2-lite": _deepseek_v2_lite,
    "deepseek-v2": _deepseek_v2,
    "deepseek-v3": _deepseek_v3,
    "tiny-dense": _tiny_dense,
    "tiny-v2": _tiny_v2,
    "tiny-v3": _tiny_v3,
    "small-v3": _small_v3,
    "small-v3-sparse": _small_v3_sparse,
}
PRESETS = tuple(BUILDERS)
OFFICIAL_PRESETS = PRESETS[:5]


def get_preset(name: str) -> ModelConfig:
    if name not in BUILDERS:
        raise UserError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return BUILDERS[name]().validate()
