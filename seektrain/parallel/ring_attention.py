"""Causal ring attention over the context-parallel ranks, forward and backward, with document masks.

Each of the ``cp`` ranks holds two chunks of every sequence (load-balanced: rank ``i`` holds chunks
``i`` and ``2·cp−1−i`` of ``2·cp``, ``seektrain.parallel.context_parallel``). Its queries attend to the
keys and values of all chunks at or before theirs: the keys and values travel around the ring (rank
``i`` sends to ``i+1``), one hop per step, ``cp`` steps in all, and each block of (query chunk, key
chunk) is merged into the running result by its log-sum-exp (the online softmax). At chunk granularity
a block is fully visible (key chunk before the query chunk), causal (the same chunk) or skipped (after
it), so the masked work is the same on every rank. Packed rows' document ids (all ranks' chunks,
gathered once per forward by ``chunk_documents``) add "same document" to each block's mask, as an
additive bias of the compute dtype.

Why our own and not ``torch.distributed.tensor.experimental.context_parallel``: torch's ring attention
(torch 2.11-2.13) is a DTensor dispatch of the CUDA SDPA kernels only
(``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``); the CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) has no handler, so it cannot run the CPU/gloo tests,
and it refuses any attention mask ("attn_bias is not supported yet"), so packed documents cannot run
either. This is the smallest piece that does: a ``torch.autograd.Function`` over the same fused kernels.

* Blocks run through a fused attention kernel that returns the log-sum-exp, in the compute dtype
  (``seektrain/platform/ring_blocks.py`` picks it: CPU flash; on CUDA flash, or memory-efficient for
  MLA's head sizes or a document mask). Where the kernel wants one head size (CPU flash), MLA's values
  are zero-padded to the query/key head size and the padding is cut from the output. Results merge in fp32 (a running
  output and log-sum-exp); a row the block's mask hides completely gets log-sum-exp −inf before the
  merge (the CPU kernel reports 0 for it).
* Keys and values travel as one [k | v] chunk in the compute dtype.
* Backward recomputes nothing by hand: each block's gradient is the kernel's backward from the *global*
  output and log-sum-exp (the standard ring-flash trick), so it is that block's share of the gradient of
  the whole softmax. Overlap: the next key/value hop is issued before a step's blocks; the step's
  accumulated dK/dV (fp32, so the ``cp`` shares add without rounding) is sent on after them and waited
  for only at the end of the next step; after ``cp`` sends it is home.
* The hops are functional all-to-alls (a new tensor each, as ``parallel/expert_parallel.py``'s), so a
  selective activation checkpoint keeps them and ``torch.compile`` can trace them.

GQA arrives with its key/value heads repeated to the query heads (``models/deepseek/attention.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from seektrain.platform.ring_blocks import BlockKernel, block_kernel

_hops = 0  # ring hops this process has issued eagerly (forward and backward): the run record counts them
# Hops of compiled calls, counted where the call is traced into the graph (torch.compile keeps no side
# effect inside an autograd.Function, and a Python int read there becomes a guard, so a recompile per
# call): an in-place add on a host tensor, which the graph replays at every call.
_compiled_hops = torch.zeros((), dtype=torch.int64)
_compiled_calls = False  # set (a store, never read inside the graph) once a compiled call counted there


def ring_hops() -> int:
    """How many key/value hops this process has issued so far (a host counter, no device sync): the
    run monitor's per-step difference goes into ``summary.json`` (``layout_ran``), so a run whose
    attention never left the rank shows 0."""
    return _hops + (int(_compiled_hops) if _compiled_calls else 0)  # eager runs read no tensor


def hops_per_call(cp: int, backward: bool) -> int:
    """Hops one ring call issues: ``cp − 1`` in forward; backward ``cp − 1`` key/value hops and ``cp`` of
    their gradient (the last one home)."""
    return (cp - 1) + ((cp - 1) + cp if backward and cp > 1 else 0)


def _start_hop(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Send ``x`` to the next ring rank and receive the previous one's (a functional all-to-all whose
    only non-empty splits are those two); returns the not yet waited-for result."""
    global _hops
    if not torch.compiler.is_compiling():  # compiled calls are counted by ring_attention
        _hops += 1
    n, rank = group.size(), group.rank()
    send, recv = [0] * n, [0] * n
    send[(rank + 1) % n] = recv[(rank - 1) % n] = x.numel()
    return torch.ops._c10d_functional.all_to_all_single(x.contiguous().view(-1), recv, send, group.group_name)


def _finish_hop(pending: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(pending).view_as(like)


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2·cp``) that context-parallel rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def _blocks(rank: int, src: int, cp: int):
    """(query slice, key slice, query chunk, key chunk, diagonal) of every block rank ``rank`` computes
    against rank ``src``'s keys (``c``-long chunks)."""
    for qh, a in enumerate(chunk_ids(rank, cp)):
        for kh, b in enumerate(chunk_ids(src, cp)):
            if b <= a:
                yield qh, kh, a, b, a == b


def _block_mask(docs, a: int, b: int, diagonal: bool, dtype):
    """(additive [B, 1, c, c] bias of ``dtype``, [B, 1, c] rows it hides completely) of the block of
    query chunk ``a`` and key chunk ``b`` of packed rows; (None, None) for one document per row (the
    kernel then applies the diagonal block's causal mask itself)."""
    if docs is None:
        return None, None
    allowed = (docs[:, a, :, None] == docs[:, b, None, :]).unsqueeze(1)
    if diagonal:
        allowed = allowed.tril()
    bias = torch.zeros(allowed.shape, dtype=dtype, device=docs.device).masked_fill_(~allowed, float("-inf"))
    return bias, ~allowed.any(-1)


def _merge(out, lse, o_b, lse_b):
    """Fold one block's (output, log-sum-exp) into the running fp32 ones, in place."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows nothing visible yet: weights 0, not NaN
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o_b * torch.exp(lse_b - safe).unsqueeze(-1))
    lse.copy_(new)


def _value_width(kernel: BlockKernel, k: torch.Tensor, v: torch.Tensor) -> int:
    """The value head size the kernel runs with: q/k's where it wants one head size, else v's own."""
    return max(k.shape[-1], v.shape[-1]) if kernel.equal_head_dims else v.shape[-1]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_in, v_in, scale: float, docs, group: ProcessGroup):
        cp, rank = group.size(), group.rank()
        ctx.dtypes = (k_in.dtype, v_in.dtype)  # gradients go back in the inputs' dtypes
        k, v = k_in.to(q.dtype), v_in.to(q.dtype)  # the compute dtype is q's (bf16 under autocast)
        kernel = block_kernel(q.device.type, q.dtype, docs is not None, k.shape[-1] == v.shape[-1])
        B, H, T, kd = k.shape
        c, vd = T // 2, v.shape[-1]
        out = torch.zeros(B, H, T, vd, device=q.device)  # fp32, as the running log-sum-exp
        lse = torch.full((B, H, T), float("-inf"), device=q.device)
        kv = torch.cat([k, _pad(v, _value_width(kernel, k, v))], dim=-1)
        with torch.autocast(q.device.type, enabled=False):
            for step in range(cp):
                pending = _start_hop(kv, group) if step < cp - 1 else None
                src = (rank - step) % cp
                for qh, kh, a, b, diagonal in _blocks(rank, src, cp):
                    qs, ks = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
                    bias, hidden = _block_mask(docs, a, b, diagonal, q.dtype)
                    o_b, lse_b = kernel.forward(
                        q[:, :, qs],
                        kv[:, :, ks, :kd],
                        kv[:, :, ks, kd:],
                        diagonal and bias is None,
                        bias,
                        scale,
                    )
                    o_b, lse_b = o_b[..., :vd].float(), lse_b.float()
                    if hidden is not None:  # the CPU kernel: output 0, log-sum-exp 0 (not −inf)
                        lse_b = lse_b.masked_fill(hidden, float("-inf"))
                        o_b = o_b.masked_fill(hidden.unsqueeze(-1), 0.0)
                    _merge(out[:, :, qs], lse[:, :, qs], o_b, lse_b)
                if pending is not None:
                    kv = _finish_hop(pending, kv)
        result = out.to(q.dtype)
        # the inputs and the output themselves: torch.compile refuses to save an intermediate that aliases
        # an input or output
        ctx.save_for_backward(q, k_in, v_in, result, lse)
        ctx.scale, ctx.docs, ctx.group = scale, docs, group
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, docs, group = ctx.scale, ctx.docs, ctx.group
        cp, rank = group.size(), group.rank()
        kernel = block_kernel(q.device.type, q.dtype, docs is not None, k.shape[-1] == v.shape[-1])
        k, v = k.to(q.dtype), v.to(q.dtype)
        T, kd, vd = q.shape[2], k.shape[-1], v.shape[-1]
        c, width = T // 2, _value_width(kernel, k, v)
        dout, out = _pad(dout.to(q.dtype), width).contiguous(), _pad(out, width)
        dq = torch.zeros(q.shape, device=q.device)  # fp32 sums of the blocks' shares
        kv = torch.cat([k, _pad(v, width)], dim=-1)
        travelling = None  # the dK/dV sent on at the end of the previous step, not yet waited for
        with torch.autocast(q.device.type, enabled=False):
            for step in range(cp):
                pending = _start_hop(kv, group) if step < cp - 1 else None
                src = (rank - step) % cp
                dkv = torch.zeros(kv.shape, device=q.device)  # this rank's share of src's chunk's gradient
                for qh, kh, a, b, diagonal in _blocks(rank, src, cp):
                    qs, ks = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
                    bias, _ = _block_mask(docs, a, b, diagonal, q.dtype)
                    dq_b, dk_b, dv_b = kernel.backward(
                        dout[:, :, qs], q[:, :, qs], kv[:, :, ks, :kd], kv[:, :, ks, kd:], out[:, :, qs],
                        lse[:, :, qs].contiguous(), diagonal and bias is None, bias, scale,
                    )  # fmt: skip
                    dq[:, :, qs] += dq_b
                    dkv[:, :, ks, :kd] += dk_b
                    dkv[:, :, ks, kd:] += dv_b
                if travelling is not None:  # the shares of the ranks that held src's chunk before
                    dkv += _finish_hop(travelling, dkv)
                travelling = _start_hop(dkv, group) if cp > 1 else dkv
                if pending is not None:
                    kv = _finish_hop(pending, kv)
            assert travelling is not None  # cp >= 1: the loop ran and set it
            dkv = _finish_hop(travelling, dkv) if cp > 1 else travelling  # home: every rank's share summed
        dk, dv = dkv[..., :kd], dkv[..., kd : kd + vd]
        k_t, v_t = ctx.dtypes
        return dq.to(q.dtype), dk.to(k_t), dv.to(v_t), None, None, None


def ring_attention(q, k, v, scale: float, docs, group: ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's two query chunks over every rank's keys/values: q [B, H, T, K],
    k [B, H, T, K], v [B, H, T, V] (T: this rank's two chunks) -> [B, H, T, V] in q's dtype. ``docs``:
    ``chunk_documents``' [B, 2·cp, T/2] document ids, or None (one document per row)."""
    if torch.compiler.is_compiling():
        global _compiled_calls
        _compiled_calls = True
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        _compiled_hops.add_(hops_per_call(group.size(), backward))
    return _RingAttention.apply(q, k, v, scale, docs, group)
