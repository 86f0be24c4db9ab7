"""Gloo's reduce-scatter against the all-to-all + local sum FSDP uses on CPU (same bytes, same result).

    python benchmarks/bench_gloo_reduce_scatter.py               # 2 ranks, 240 MB fp32 and 120 MB bf16
    python benchmarks/bench_gloo_reduce_scatter.py --mb 64 --nproc 4

Starts its own ranks (torch.distributed.run, gloo, 1 thread each); prints the best of ``--iters`` for
each way and whether their outputs are identical.
"""

from __future__ import annotations

import argparse
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

    from seektrain.parallel.gloo_reduce_scatter import AllToAllReduceScatter

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = AllToAllReduceScatter()
    for dtype in (torch.float32, torch.bfloat16):
        numel = int(mb * 2**20 / 4) // world * world  # the same element count in both dtypes
        inp = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)
        native, ours = torch.empty(numel // world, dtype=dtype), torch.empty(numel // world, dtype=dtype)
        t_native = _best(lambda: dist.reduce_scatter_tensor(native, inp, op=dist.ReduceOp.AVG), iters)
        t_ours = _best(lambda: comm(ours, inp, dist.group.WORLD, dist.ReduceOp.AVG), iters)
        if rank == 0:
            print(f"{str(dtype):15s} {numel * inp.element_size() / 2**20:7.0f} MiB in: gloo reduce_scatter "
                  f"{t_native:.3f} s, all-to-all + sum {t_ours:.3f} s ({t_native / t_ours:.2f}x), "
                  f"identical: {torch.equal(native, ours)}", flush=True)
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, "--worker", "--mb", str(args.mb), "--iters", str(args.iters)]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
