"""The all-to-all reduce-scatter FSDP uses on gloo gives what gloo's own reduce_scatter gives (SUM and
AVG, fp32 and bf16, sizes that are not powers of two), on 2 real gloo processes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seektrain.parallel.gloo_reduce_scatter import AllToAllReduceScatter

WORLD = 2


def _worker(rank: int, out_dir: str) -> None:
    store = dist.FileStore(os.path.join(out_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    comm = AllToAllReduceScatter()
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            gen = torch.Generator().manual_seed(rank)
            inp = torch.randn(WORLD * 1003, generator=gen).to(dtype)
            ref = torch.empty(1003, dtype=dtype)
            dist.reduce_scatter_tensor(ref, inp.clone(), op=op)
            out = comm.allocate((1003,), dtype=dtype, device=torch.device("cpu"))
            comm(out, inp, dist.group.WORLD, op)
            if not torch.equal(out, ref):
                failures.append(f"{dtype} {op}: max diff {(out.float() - ref.float()).abs().max().item()}")
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as fh:
        fh.write("\n".join(failures))
    dist.destroy_process_group()


def test_matches_gloo_reduce_scatter(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        assert (tmp_path / f"rank{rank}").read_text() == ""
