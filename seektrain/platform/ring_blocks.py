"""The fused attention kernel context parallelism's ring runs each block through, chosen by platform.

The ring (``seektrain/parallel/ring_attention.py``) computes one (query chunk, key chunk) block at a time
and merges the blocks by their log-sum-exp, so it needs a kernel that returns the log-sum-exp and a
backward that takes it (the global one, so each block's gradient is its share of the whole softmax's).
PyTorch has three, each with its own signature; ``block_kernel`` picks one and hides the differences:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``..._backward``), any float dtype, an
  additive float mask of q's dtype (a boolean one is refused), q, k and v of one head size. A row the mask
  hides completely comes back as output 0 and log-sum-exp 0 (not −inf): the ring corrects those.
* CUDA, bf16/fp16, one head size for q, k and v, no document mask: ``aten._scaled_dot_product_flash_attention``
  (FlashAttention-2). Its backward's varlen and dropout arguments are unused without dropout and are
  passed as stand-ins.
* CUDA otherwise (MLA's value head size below its query/key's, a document mask, fp32):
  ``aten._scaled_dot_product_efficient_attention`` (memory-efficient; an additive bias, any value head
  size, ``compute_log_sumexp=True``); its log-sum-exp comes back padded to a multiple of 32 queries and
  is cut to the block's. The bias is laid out with its last dimension's stride a multiple of 16
  elements, as the kernel requires (the SDPA front end pads the same way).

On CUDA this is the choice ``F.scaled_dot_product_attention`` makes for the same inputs without cp
(flash where its constraints hold, else memory-efficient), so cp does not change the attention kernel:
MLA is not zero-padded there (padding its values to 192 would add a fifth to its attention FLOPs, which
dominate at 128K). On CPU the flash kernel is the only fused one, so MLA's values are padded, as the
CPU policy pads them without cp (``platform/cpu_kernels.py``).

The calls follow torch 2.13's op schemas; the CUDA ones are checked on meta tensors in
``tests/test_ring_attention.py``, which is all a CPU machine can run of them. Whether torch 2.11 (the GPU
box's) takes them the same way is not checked here, and **the CUDA path has not run on a GPU yet**
(``benchmarks/bench_gpu.py``'s ``ring`` row runs it when a device is lent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

aten = torch.ops.aten
_BIAS_ALIGN = 16  # memory-efficient attention: the bias's row stride, in elements


@dataclass(frozen=True)
class BlockKernel:
    """``forward(q, k, v, causal, bias, scale) -> (out, lse)``: lse fp32 [B, H, Tq];
    ``backward(dout, q, k, v, out, lse, causal, bias, scale) -> (dq, dk, dv)`` from the (global) out and
    lse; ``bias``: None or an additive [B, 1, Tq, Tk] mask of q's dtype; ``causal``: the block is
    diagonal and unmasked. ``equal_head_dims``: v must have q's head size (the ring zero-pads it)."""

    name: str
    forward: Callable
    backward: Callable
    equal_head_dims: bool


def _cpu_forward(q, k, v, causal, bias, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, bias, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _flash_forward(q, k, v, causal, bias, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, bias, scale):
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)  # rng state: read only with dropout
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    tq, tk = q.shape[2], k.shape[2]
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, tq, tk, 0.0, causal, seed, offset, scale=scale
    )


def _aligned_bias(bias, heads: int):
    """``bias`` [B, 1, Tq, Tk] as the memory-efficient kernel reads it: [B, H, Tq, Tk] (heads broadcast)
    over storage whose rows are padded to a multiple of ``_BIAS_ALIGN``."""
    if bias is None:
        return None
    b, _, tq, tk = bias.shape
    padded = -(-tk // _BIAS_ALIGN) * _BIAS_ALIGN
    storage = bias.new_empty(b, 1, tq, padded)
    storage[..., :tk] = bias
    return storage[..., :tk].expand(b, heads, tq, tk)


def _efficient_forward(q, k, v, causal, bias, scale):
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
        q, k, v, _aligned_bias(bias, q.shape[1]), True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _efficient_backward(dout, q, k, v, out, lse, causal, bias, scale):
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # read only with dropout
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, _aligned_bias(bias, q.shape[1]), out, lse, seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


CPU_FLASH = BlockKernel("cpu_flash", _cpu_forward, _cpu_backward, equal_head_dims=True)
CUDA_FLASH = BlockKernel("cuda_flash", _flash_forward, _flash_backward, equal_head_dims=True)
CUDA_EFFICIENT = BlockKernel("cuda_efficient", _efficient_forward, _efficient_backward, equal_head_dims=False)


def block_kernel(device_type: str, dtype: torch.dtype, masked: bool, equal_head_dims: bool) -> BlockKernel:
    """The ring's block kernel for tensors of ``dtype`` on a ``device_type`` device; ``masked``: the
    rows are packed documents (an additive bias per block); ``equal_head_dims``: v's head size is q's."""
    if device_type == "cpu":
        return CPU_FLASH
    if device_type == "cuda":
        flash = equal_head_dims and not masked and dtype in (torch.bfloat16, torch.float16)
        return CUDA_FLASH if flash else CUDA_EFFICIENT
    raise ValueError(f"context parallelism's ring attention has no block kernel for {device_type} devices")
