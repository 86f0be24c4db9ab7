"""Collective bandwidth, measured and reported as nccl-tests defines it, and the slowest link.

For a collective on ``n`` ranks over ``size`` bytes taking ``t`` seconds (the slowest rank's mean):

* ``algbw = size / t``;
* ``busbw = algbw × factor``, the bytes each link carries, comparable with the hardware's link speed:
  all_reduce ``2(n-1)/n``, all_gather and reduce_scatter ``(n-1)/n``, all_to_all ``(n-1)/n``.

``size`` is nccl-tests' too: the all_reduce buffer; the gathered output of all_gather; the input of
reduce_scatter (``n`` × its output); the bytes each rank sends and receives in all_to_all.

Collectives move at the pace of their slowest link, so a table alone cannot name it: each link of the
ring (rank r → r+1) is then timed on its own, the others idle, and the slowest is named with its hosts.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from seektrain.errors import UserError
from seektrain.parallel.dist_env import node_label

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
DEFAULT_SIZES = (2**20, 2**24, 2**27)  # 1 MiB, 16 MiB, 128 MiB
SLOW_LINK = 0.5  # a link below half the median link bandwidth is a warning


def parse_sizes(text: str) -> list[int]:
    """``4K,1M,64M`` (K/M/G: binary units) -> bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for item in (s.strip().upper() for s in text.split(",") if s.strip()):
        try:
            sizes.append(int(float(item[:-1]) * units[item[-1]]) if item[-1] in units else int(item))
        except (ValueError, KeyError):
            raise UserError(f"--sizes {text!r}: give byte counts like 4K,1M,64M") from None
    if not sizes or min(sizes) <= 0:
        raise UserError(f"--sizes {text!r}: give positive byte counts like 4K,1M,64M")
    return sizes


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _time(op, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call of ``op``, the slowest rank's (all ranks get the same number)."""
    for _ in range(warmup):
        op()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    _sync(device)
    mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return mean.item()


def _ops(size: int, n: int, device: torch.device) -> dict:
    """Each collective on fp32 buffers of nccl-tests' ``size`` (rounded to whole elements per rank)."""
    per_rank = max(1, size // 4 // n)  # fp32 elements of one rank's chunk
    full = torch.ones(per_rank * n, device=device)
    chunk = torch.ones(per_rank, device=device)
    out_full = torch.empty_like(full)
    out_chunk = torch.empty_like(chunk)
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: all_gather(out_full, chunk),
        "reduce_scatter": lambda: reduce_scatter(out_chunk, full),
        "all_to_all": lambda: dist.all_to_all_single(out_full, full),
    }, per_rank * n * 4


def measure(device: torch.device, sizes: list[int], iters: int = 5) -> dict:
    """Run on every rank; returns the table (the same on every rank) and the link measurements."""
    n = dist.get_world_size()
    rows = []
    for size in sizes:
        ops, nbytes = _ops(size, n, device)
        for name, op in ops.items():
            t = _time(op, device, iters)
            algbw = nbytes / t / 1e9
            rows.append(
                {
                    "op": name,
                    "bytes": nbytes,
                    "time_us": t * 1e6,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * BUS_FACTOR[name](n),
                }
            )
    return {
        "world_size": n,
        "backend": dist.get_backend(),
        "device": device.type,
        "rows": rows,
        "links": measure_links(device, max(sizes), iters),
    }


def measure_links(device: torch.device, size: int, iters: int) -> list[dict]:
    """Bandwidth of each ring link r -> (r+1) % n, one link at a time (GB/s, the receiver's clock)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    hosts = [None] * n
    dist.all_gather_object(hosts, node_label())
    buf = torch.ones(max(1, size // 4), device=device)
    links = []
    for src in range(n if n > 2 else 1):  # with 2 ranks the ring has one pair
        dst = (src + 1) % n
        seconds = torch.zeros(1, dtype=torch.float64, device=device)
        dist.barrier()
        if rank in (src, dst):
            for i in range(iters + 1):  # the first exchange warms the connection up
                if i == 1:
                    _sync(device)
                    start = time.perf_counter()
                dist.send(buf, dst) if rank == src else dist.recv(buf, src)
            _sync(device)
            if rank == dst:
                seconds[0] = (time.perf_counter() - start) / iters
        dist.all_reduce(seconds)
        links.append(
            {
                "src": src,
                "dst": dst,
                "src_host": hosts[src],
                "dst_host": hosts[dst],
                "gbps": buf.numel() * 4 / seconds.item() / 1e9,
            }
        )
    return links


def slowest_link(result: dict) -> tuple[dict, float, bool] | None:
    """(the slowest link, the median link bandwidth, whether it is slow enough to warn about)."""
    links = result.get("links") or []
    if not links:
        return None
    slowest = min(links, key=lambda link: link["gbps"])
    median = statistics.median(link["gbps"] for link in links)
    return slowest, median, slowest["gbps"] < SLOW_LINK * median


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def render_table(result: dict) -> str:
    n = result["world_size"]
    lines = [
        f"collective bandwidth on {n} ranks ({result['backend']}, {result['device']}); nccl-tests "
        "definitions: algbw = size / time, busbw = algbw x (all_reduce 2(n-1)/n; all_gather, "
        "reduce_scatter, all_to_all (n-1)/n)",
        f"{'op':<15}{'size':>10}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['op']:<15}{_size(r['bytes']):>10}{r['time_us']:>12.1f}{r['algbw_gbps']:>14.3f}"
            f"{r['busbw_gbps']:>14.3f}"
        )
    found = slowest_link(result)
    if found:
        link, median, slow = found
        lines.append(
            f"slowest link: rank {link['src']} ({link['src_host']}) -> rank {link['dst']} "
            f"({link['dst_host']}): {link['gbps']:.3f} GB/s, median of {len(result['links'])} ring "
            f"link(s) {median:.3f} GB/s" + (" -- SLOW: check this link/node" if slow else "")
        )
    return "\n".join(lines)
