"""Causal ring attention over the context-parallel ranks, forward and backward, with document masks.

Each of the ``cp`` ranks holds two chunks of every sequence (load-balanced: rank ``i`` holds chunks
``i`` and ``2·cp−1−i`` of ``2·cp``, ``seektrain.parallel.context_parallel``). Its queries attend to the
keys and values of all chunks at or before theirs: the keys and values travel around the ring (rank
``i`` sends to ``i+1``), one hop per step, ``cp`` steps in all, and each block of (query chunk, key
chunk) is merged into the running result by its log-sum-exp (the online softmax). At chunk granularity
a block is fully visible (key chunk before the query chunk), causal (the same chunk) or skipped (after
it), so the masked work is the same on every rank. Packed rows' document ids (all ranks' chunks,
gathered once per forward by ``chunk_documents``) add "same document" to each block's mask.

Why our own and not ``torch.distributed.tensor.experimental.context_parallel``: torch's ring attention
(torch 2.11-2.13) is a DTensor dispatch of the CUDA SDPA kernels only
(``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``); the CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) has no handler, so it cannot run the CPU/gloo tests,
and it refuses any attention mask ("attn_bias is not supported yet"), so packed documents cannot run
either. This is the smallest piece that does: a ``torch.autograd.Function`` whose backward is written
out (flash attention's: each block's probabilities recomputed from the saved log-sum-exp), so only q, k,
v, the output and the log-sum-exp are kept, never a [T, T] score matrix. Blocks are plain matmuls in
fp32 (any head dims: MLA's query/key 192 and value 128; GQA arrives with its KV heads repeated). The
hops are functional all-to-alls (a new tensor each, as ``parallel/expert_parallel.py``'s), issued
before the block they overlap and waited for after it, so a selective activation checkpoint keeps them
and ``torch.compile`` can trace them.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

_hops = 0  # ring hops this process has issued (forward and backward): the run record counts them


def ring_hops() -> int:
    """How many key/value hops this process has issued so far (a plain counter, no device sync): the
    run monitor's per-step difference goes into ``summary.json`` (``layout_ran``), so a run whose
    attention never left the rank shows 0."""
    return _hops


def _start_hop(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Send ``x`` to the next ring rank and receive the previous one's (a functional all-to-all whose
    only non-empty splits are those two); returns the not yet waited-for result."""
    global _hops
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
    """(query half, key half, causal) of every block rank ``rank`` computes against rank ``src``'s keys."""
    for qh, a in enumerate(chunk_ids(rank, cp)):
        for kh, b in enumerate(chunk_ids(src, cp)):
            if b <= a:
                yield qh, kh, a == b


def _allowed(docs, a: int, b: int, causal: bool, c: int, device) -> torch.Tensor | None:
    """[B or 1, 1, c, c] True where a query of chunk ``a`` may see a key of chunk ``b``; None: all."""
    mask = None
    if docs is not None:
        mask = (docs[:, a, :, None] == docs[:, b, None, :]).unsqueeze(1)
    if causal:
        tril = torch.ones(c, c, dtype=torch.bool, device=device).tril()
        mask = tril if mask is None else mask & tril
    return mask


def _scores(q, k, scale, allowed):
    s = (q @ k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _merge(out, lse, o_b, lse_b):
    """Fold one block's (output, log-sum-exp) into the running ones, in place."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows nothing visible yet: weights 0, not NaN
    out.mul_(torch.exp(lse - safe)).add_(o_b * torch.exp(lse_b - safe))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, docs, group: ProcessGroup):
        cp, rank = group.size(), group.rank()
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)  # bf16 under autocast: the gradients go back in them
        q, k, v = q.float(), k.float(), v.float()
        B, H, T, _ = q.shape
        c, kd = T // 2, k.shape[-1]
        out = torch.zeros(B, H, T, v.shape[-1], device=q.device)
        lse = torch.full((B, H, T, 1), float("-inf"), device=q.device)
        kv = torch.cat([k, v], dim=-1)
        for step in range(cp):
            pending = _start_hop(kv, group) if step < cp - 1 else None
            src = (rank - step) % cp
            for qh, kh, causal in _blocks(rank, src, cp):
                qs, ks = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
                a, b = chunk_ids(rank, cp)[qh], chunk_ids(src, cp)[kh]
                s = _scores(q[:, :, qs], kv[:, :, ks, :kd], scale, _allowed(docs, a, b, causal, c, q.device))
                m = s.amax(-1, keepdim=True)
                m = m.masked_fill(m == float("-inf"), 0.0)
                p = torch.exp(s - m)
                total = p.sum(-1, keepdim=True)
                o_b = (p @ kv[:, :, ks, kd:]) / total.clamp_min(torch.finfo(p.dtype).tiny)
                _merge(out[:, :, qs], lse[:, :, qs], o_b, m + torch.log(total))
            if pending is not None:
                kv = _finish_hop(pending, kv)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.docs, ctx.group = scale, docs, group
        return out.to(ctx.dtypes[0])

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, docs, group = ctx.scale, ctx.docs, ctx.group
        cp, rank = group.size(), group.rank()
        dout = dout.float()
        c, kd = q.shape[2] // 2, k.shape[-1]
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O): the softmax backward's correction
        dq = torch.zeros_like(q)
        kv = torch.cat([k, v], dim=-1)
        dkv = torch.zeros_like(kv)  # travels with its keys and values, gathering every rank's share
        for step in range(cp):
            if step > 0:  # the keys/values move on; their gradient so far travels with them
                pending_kv, pending_d = _start_hop(kv, group), _start_hop(dkv, group)
                kv, dkv = _finish_hop(pending_kv, kv), _finish_hop(pending_d, dkv)
            src = (rank - step) % cp
            for qh, kh, causal in _blocks(rank, src, cp):
                qs, ks = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
                a, b = chunk_ids(rank, cp)[qh], chunk_ids(src, cp)[kh]
                kb, vb = kv[:, :, ks, :kd], kv[:, :, ks, kd:]
                s = _scores(q[:, :, qs], kb, scale, _allowed(docs, a, b, causal, c, q.device))
                p = torch.exp(s - lse[:, :, qs])
                do = dout[:, :, qs]
                ds = p * (do @ vb.transpose(-1, -2) - delta[:, :, qs])
                dq[:, :, qs] += (ds @ kb) * scale
                dkv[:, :, ks, :kd] += (ds.transpose(-1, -2) @ q[:, :, qs]) * scale
                dkv[:, :, ks, kd:] += p.transpose(-1, -2) @ do
        if cp > 1:  # after cp - 1 hops the gradient sits one rank short of its owner
            dkv = _finish_hop(_start_hop(dkv, group), dkv)
        dk, dv = dkv.split([kd, v.shape[-1]], dim=-1)
        dq_t, dk_t, dv_t = ctx.dtypes
        return dq.to(dq_t), dk.to(dk_t), dv.to(dv_t), None, None, None


def ring_attention(q, k, v, scale: float, docs, group: ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's two query chunks over every rank's keys/values: q [B, H, T, K],
    k [B, H, T, K], v [B, H, T, V] (T: this rank's two chunks) -> [B, H, T, V] in q's dtype. ``docs``:
    ``chunk_documents``' [B, 2·cp, T/2] document ids, or None (one document per row)."""
    return _RingAttention.apply(q, k, v, scale, docs, group)
