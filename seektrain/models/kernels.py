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


def causal_attention(
    q_BHTK: torch.Tensor,
    k_BHTK: torch.Tensor,
    v_BHTV: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention over heads of equal count, [B, H, T, V] (torch picks the kernel).
    ``mask``: ``None`` (plain causal, the fast path), or what ``Kernels.document_mask`` built for packed
    rows; here that of ``document_causal_mask``."""
    if mask is None:
        return F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, attn_mask=mask, scale=scale)


def document_causal_mask(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T], True where query i may attend key j: the same document and j <= i. The diagonal is
    always allowed, so no row is empty (an empty row would be NaN)."""
    T = document_ids_BT.shape[1]
    same_BTT = document_ids_BT[:, :, None] == document_ids_BT[:, None, :]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=document_ids_BT.device).tril()
    return (same_BTT & causal_TT).unsqueeze(1)


@dataclass(frozen=True)
class Kernels:
    """``attention(q, k, v, scale, mask)``: causal attention with ``causal_attention``'s contract.
    ``expert_row_multiple``: every expert's group of token rows is padded with zero rows up to a
    multiple of this before the grouped GEMM (1: no padding); the result is the same.
    ``grouped_mm_dtypes``, ``grouped_mm_dim_multiple``: the experts run as a grouped GEMM for inputs of
    these dtypes when every weight dimension is a multiple of this (no dtype: always the batched matmul)."""

    attention: Callable[..., torch.Tensor] = causal_attention
    expert_row_multiple: int = 1
    grouped_mm_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    grouped_mm_dim_multiple: int = 1

    def grouped_mm_covers(self, x: torch.Tensor, *dims: int) -> bool:
        """Whether the experts' grouped GEMM takes input ``x`` with weight dimensions ``dims``."""
        return x.dtype in self.grouped_mm_dtypes and all(d % self.grouped_mm_dim_multiple == 0 for d in dims)

    # Packed rows (data.packing, data.document_mask): attention causal within each document only.
    # ``document_mask(document_ids [B, T])`` is built once per forward and handed to every attention
    # call as its ``mask``; the two must agree on what a mask is (a boolean tensor here, a FlexAttention
    # block mask in ``models/flex_attention.py``).
    document_mask: Callable[[torch.Tensor], object] = document_causal_mask
