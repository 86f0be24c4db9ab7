"""The few computations whose fastest form depends on the platform, handed to the model at construction.

The model itself stays free of platform branches: attention and the MoE experts call what their
``Kernels`` say, including whether the experts may use torch's grouped GEMM (which exists for some
devices, dtypes and shapes only; elsewhere a padded batched matmul computes the same). The defaults here
are the plain, unpadded computations, with the grouped GEMM where torch's CPU build has it (fp32, bf16);
a platform policy (``seektrain.platform.policy_for(device).model_kernels()``) hands in its own choices
(the generic one: the grouped GEMM only where CUDA has it), which must give the same outputs and
gradients (``tests/test_platform.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def causal_attention(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal softmax attention over heads of equal count, [B, H, T, V] (torch picks the kernel)."""
    return F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, is_causal=True, scale=scale)


@dataclass(frozen=True)
class Kernels:
    """``attention(q, k, v, scale)``: causal attention with ``causal_attention``'s contract.
    ``expert_row_multiple``: every expert's group of token rows is padded with zero rows up to a
    multiple of this before the grouped GEMM (1: no padding); the result is the same.
    ``grouped_mm_dtypes``, ``grouped_mm_dim_multiple``: the experts run as a grouped GEMM for inputs of
    these dtypes when every weight dimension is a multiple of this (no dtype: always the batched matmul)."""

    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] = causal_attention
    expert_row_multiple: int = 1
    grouped_mm_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    grouped_mm_dim_multiple: int = 1

    def grouped_mm_covers(self, x: torch.Tensor, *dims: int) -> bool:
        """Whether the experts' grouped GEMM takes input ``x`` with weight dimensions ``dims``."""
        return x.dtype in self.grouped_mm_dtypes and all(d % self.grouped_mm_dim_multiple == 0 for d in dims)
