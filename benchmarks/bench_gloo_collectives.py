"""Gloo's all-gather and reduce-scatter against the point-to-point ones FSDP uses on CPU (same bytes).

    python benchmarks/bench_gloo_collectives.py               # 2 ranks, 240 MiB fp32 / 120 MiB bf16 per rank
    python benchmarks/bench_gloo_collectives.py --mb 64 --nproc 4

Starts its own ranks (torch.distributed.run, gloo, 1 thread each); prints the best of ``--iters`` for
each way, the ratio, and whether their outputs are identical (the reduce-scatter on more than 2 ranks
may differ in the last bit: another summation order).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time


def _best(fn, iters: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def worker(mb: float, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from seektrain.platform.cpu_gloo_collectives import P2PAllGather, P2PReduceScatter

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    group, avg = dist.group.WORLD, dist.ReduceOp.AVG
    all_gather, reduce_scatter = P2PAllGather(), P2PReduceScatter()
    for dtype in (torch.float32, torch.bfloat16):
        numel = int(mb * 2**20 / 4) // world * world  # the same element count in both dtypes
        size_mib = numel * torch.empty((), dtype=dtype).element_size() / 2**20
        inp = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)
        shard = inp[: numel // world]
        outs = {
            k: torch.empty(n, dtype=dtype)
            for k, n in (
                ("rs_gloo", numel // world),
                ("rs_p2p", numel // world),
                ("ag_gloo", numel),
                ("ag_p2p", numel),
            )
        }
        t = {
            "rs_gloo": _best(
                functools.partial(dist.reduce_scatter_tensor, outs["rs_gloo"], inp, op=avg), iters
            ),
            "rs_p2p": _best(functools.partial(reduce_scatter, outs["rs_p2p"], inp, group, avg), iters),
            "ag_gloo": _best(functools.partial(dist.all_gather_into_tensor, outs["ag_gloo"], shard), iters),
            "ag_p2p": _best(functools.partial(all_gather, outs["ag_p2p"], shard, group), iters),
        }
        if rank == 0:
            for what, key in (("reduce-scatter", "rs"), ("all-gather", "ag")):
                gloo, p2p = t[f"{key}_gloo"], t[f"{key}_p2p"]
                print(
                    f"{dtype!s:15s} {what:14s} {size_mib:8.2f} MiB: gloo {gloo * 1e3:8.2f} ms, "
                    f"point-to-point {p2p * 1e3:8.2f} ms ({gloo / p2p:.2f}x), identical: "
                    f"{torch.equal(outs[f'{key}_gloo'], outs[f'{key}_p2p'])}",
                    flush=True,
                )
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--mb", type=float, default=240, help="MiB of fp32 input per rank (bf16: half the bytes)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.mb, args.iters)
        return 0
    print(f"{args.nproc} ranks, gloo, 1 thread each; load avg {os.getloadavg()}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        __file__,
        "--worker",
        "--mb",
        str(args.mb),
        "--iters",
        str(args.iters),
    ]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
