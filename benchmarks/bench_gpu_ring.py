"""bench_gpu.py's ``ring`` row: context parallelism's ring attention (``parallel/ring_attention.py``) on
one device against plain attention, at the model's attention shape (heads, query/key and value head
sizes: MLA's 192/128 for the MoE model), ``--batch`` x ``--seq`` tokens, bf16, forward + backward.

One device holds one cp rank, so the ring runs over a one-rank group: its two chunks, three blocks (two
diagonal, one full) through the block kernel the platform picks (``platform/ring_blocks.py``: on CUDA
flash, or the memory-efficient kernel for MLA), merged by log-sum-exp; no hops. That is the part of the
ring a GPU has never run: the row first checks the ring's output and q/k/v gradients against plain
attention on the same inputs (largest error over the largest value; fp32 attention is the reference),
then times both. Tokens/s and MFU count attention alone (``observe.flops.attention_flops_per_token`` of
one layer)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench_gpu_common import peak_mem_gib, sync
from seektrain.models.kernels import causal_attention
from seektrain.observe.flops import attention_flops_per_token


def _one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _timed(fn, steps: int, warmup: int, device) -> list[float]:
    import time

    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def ring_row(cfg, args, device, peak) -> dict:
    """The figures of the ``ring`` row for model config ``cfg`` (see the module docstring)."""
    import statistics

    from seektrain.parallel.ring_attention import ring_attention

    group = _one_rank_group()
    heads, qk, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.value_head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, heads, args.seq)
    q, k = (torch.randn(*shape, qk, generator=gen, device=device) for _ in range(2))
    val = torch.randn(*shape, v, generator=gen, device=device)
    dout = torch.randn(*shape, v, generator=gen, device=device)
    scale = qk**-0.5

    def run(attend, dtype):
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, val)]
        out = attend(*ins)
        out.backward(dout.to(dtype))
        return [out.detach(), *(t.grad for t in ins)]

    def ring(a, b, c):
        return ring_attention(a, b, c, scale, None, group)

    def plain(a, b, c):
        return causal_attention(a, b, c, scale)

    want = run(plain, torch.float32)
    errors = {}
    for name, attend in (("ring", ring), ("plain", plain)):
        got = run(attend, torch.bfloat16)
        errors[name] = max(
            ((g.float() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True)
        )
    tokens = args.batch * args.seq
    flops = attention_flops_per_token(cfg, args.seq) / (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    row = {"heads": heads, "qk_head_dim": qk, "v_head_dim": v, "max_rel_error_bf16": errors["ring"]}
    row["plain_max_rel_error_bf16"] = errors["plain"]
    for name, attend in (("plain", plain), ("ring", ring)):
        med = statistics.median(
            _timed(lambda a=attend: run(a, torch.bfloat16), args.iters, args.warmup, device)
        )
        prefix = "" if name == "ring" else "plain_"
        row[prefix + "tokens_per_s"] = tokens / med
        row[prefix + "mfu"] = tokens / med * flops / peak if peak else None
    return {**row, "peak_mem_gib": peak_mem_gib(device)}
