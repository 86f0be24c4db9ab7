"""Tolerances for comparing matmul results that come out of different reduction orders.

Two computations of the same dot products (a grouped GEMM against a loop over experts, a padded batched
matmul against plain ``mm``, a fused kernel against a reference) sum the same ``k`` products in a
different order: the CPU's BLAS splits ``k`` over SIMD lanes and blocks by the vector width (8 fp32 lanes
on AVX2, 16 on AVX-512, tiles on AMX) and by the matrix shape, so the rounding differs. Each sum is off
from the exact one by at most ``k * eps * sum|x_i w_i|`` (the worst case), typically ``sqrt(k) * eps``
times the terms' scale (the rounding errors are about independent). A fixed ``atol=1e-5`` ignores both
the reduction length and the values' scale: on AVX2 a [19, 16] x [16, 16] expert product with outputs
of a few hundred differs from the per-expert loop by 1.5e-5 (well under one ulp of the output's scale).
"""

from __future__ import annotations

import math

import torch


def fp32_matmul_tol(k: int, magnitude: float, dtype: torch.dtype = torch.float32, c: float = 2.0) -> dict:
    """``assert_close`` keywords for two results of a product with reduction length ``k`` (for a chain
    of products, the sum of their reduction lengths) whose terms and outputs are at most about
    ``magnitude`` (e.g. ``reference.abs().max()``): ``atol = c * sqrt(k) * eps(dtype) * magnitude``,
    ``rtol = 0`` (the scale is in ``magnitude``). ``c = 2`` leaves a margin of about 5 over what an AVX2-only CPU
    measured for the expert products here (20 seeds); a real error (an adapter off by 1%) is orders above."""
    eps = torch.finfo(dtype).eps
    return dict(atol=c * math.sqrt(k) * eps * float(magnitude), rtol=0.0)


def forward_chain_k(cfg, seq_len: int) -> int:
    """The summed reduction length of a model's forward (and, doubled, of forward + backward): per layer
    the attention projections and output (about 4 x hidden), the score and value products (head dim +
    sequence length) and the MLP (hidden + intermediate), then the LM head. Rounding differences of two
    reduction orders add up along this chain, so it is the ``k`` of ``fp32_matmul_tol`` for a whole
    model's logits, losses and gradients (up to the constant, which covers softmax and norms)."""
    inner = max(cfg.intermediate_size, getattr(cfg, "moe_intermediate_size", 0))  # a dense family has none
    per_layer = 5 * cfg.hidden_size + inner + cfg.head_dim + seq_len
    return cfg.num_hidden_layers * per_layer + cfg.hidden_size


def model_tol(cfg, seq_len: int, magnitude: float, backward: bool = False, c: float = 2.0) -> dict:
    """``assert_close`` keywords for a whole model's outputs (logits, gradients) computed two ways that
    differ only in reduction order (packing, padding, sharding, a fused kernel): ``fp32_matmul_tol``
    over ``forward_chain_k`` (twice that for gradients, whose chain runs forward then back)."""
    k = forward_chain_k(cfg, seq_len) * (2 if backward else 1)
    return fp32_matmul_tol(k, magnitude, c=c)


def model_rel(cfg, seq_len: int, backward: bool = False, c: float = 2.0) -> float:
    """The relative tolerance of a loss (a mean of per-token cross-entropies whose logits carry the
    chain's rounding, ``c * sqrt(k) * eps`` of their scale) computed two ways that differ only in
    reduction order; for ``pytest.approx(..., rel=)``."""
    k = forward_chain_k(cfg, seq_len) * (2 if backward else 1)
    return c * math.sqrt(k) * torch.finfo(torch.float32).eps
