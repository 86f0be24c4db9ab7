"""The plain GPT's cost hooks (``seektrain.models.registry.FamilyCosts``): bytes per token of one
tensor-parallel rank that its modules save for backward. Dense multi-head attention only: no MoE, no
latents, no shared RoPE columns."""

from __future__ import annotations

from plain_gpt.config import GPTConfig

FP32 = 4


def attention_bytes(cfg: GPTConfig, a: int, tp: int, pad_values: bool, ring: bool) -> float:
    """The fused SDPA kernel keeps q, k, v, its output and the fp32 log-sum-exp; o_proj keeps its input
    (the output re-laid-out [B, T, D]). Heads have one size, so nothing is padded."""
    h = cfg.num_attention_heads / tp
    return 5 * a * h * cfg.head_dim + FP32 * h


def selective_attention_bytes(cfg: GPTConfig, a: int, tp: int, pad_values: bool) -> float:
    """q, k, v (the projections' outputs), the kernel's output and log-sum-exp."""
    h = cfg.num_attention_heads / tp
    return 4 * a * h * cfg.head_dim + FP32 * h


def dense_mlp_bytes(cfg: GPTConfig, a: int, tp: int) -> float:
    """up_proj's output (GELU's input) and GELU's output (down_proj's input)."""
    return 2 * a * cfg.intermediate_size / tp


def no_moe(*args) -> float:
    raise ValueError("the plain GPT has no MoE layer")


def none(*args) -> None:
    return None
