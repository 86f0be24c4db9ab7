"""Document-causal attention with FlexAttention block masks: the masked-attention kernel of accelerators.

Why not the boolean [B, 1, T, T] mask of ``kernels.document_causal_mask``: SDPA with an explicit mask
falls back to kernels that read the whole T x T mask and compute every masked block. A FlexAttention
block mask records which blocks of 128 x 128 are empty, full or partial, so a packed row costs about
what its documents would cost alone (torchtitan's default for DeepSeek-V3). FlexAttention has no
backward on the CPU (torch 2.13), so the CPU policy keeps the boolean mask; everything here is imported
at the first call, so a CPU-only process never loads it.
"""

from __future__ import annotations

import functools

import torch

from seektrain.models.kernels import causal_attention


@functools.cache
def _compiled_flex():
    """FlexAttention compiled once per process (its eager form materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(document_ids_BT: torch.Tensor):
    """The block mask of "same document and key <= query" for every row of ``document_ids_BT``."""
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_idx, kv_idx):
        return (document_ids_BT[b, q_idx] == document_ids_BT[b, kv_idx]) & (kv_idx <= q_idx)

    B, T = document_ids_BT.shape
    return create_block_mask(document_causal, B, None, T, T, device=document_ids_BT.device)


def flex_causal_attention(
    q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, scale: float, mask=None
) -> torch.Tensor:
    """``causal_attention``'s contract with ``mask`` a block mask of ``document_block_mask``; plain causal
    rows (no mask) keep SDPA's fused kernels."""
    if mask is None:
        return causal_attention(q_BHTK, k_BHTK, v_BHTV, scale)
    return _compiled_flex()(q_BHTK, k_BHTK, v_BHTV, block_mask=mask, scale=scale)
