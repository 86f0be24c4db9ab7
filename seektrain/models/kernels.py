"""The few computations whose fastest form depends on the platform, handed to the model at construction.

The model itself stays free of platform branches: attention and the MoE experts call what their
``Kernels`` say. The defaults here are the plain, unpadded computations, right on every device; a
platform policy (``seektrain.platform.policy_for(device).model_kernels()``) may hand in faster
equivalents, which must give the same outputs and gradients (``tests/test_platform.py``).
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
    multiple of this before the grouped GEMM (1: no padding); the result is the same."""

    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] = causal_attention
    expert_row_multiple: int = 1
