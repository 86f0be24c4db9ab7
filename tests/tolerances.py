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
