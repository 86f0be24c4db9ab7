"""The point-to-point all-gather and reduce-scatter FSDP uses on gloo give what gloo's own collectives
give, on real gloo processes: bit-identical on 2 ranks (SUM and AVG, fp32 and bf16, sizes that are not
powers of two), equal within rounding on 3 ranks, and an async all-gather overlapping a reduce-scatter
on the same group keeps their messages apart."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seektrain.parallel.gloo_collectives import P2PAllGather, P2PReduceScatter

N = 1003


def _worker(rank: int, world: int, out_dir: str) -> None:
    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    all_gather, reduce_scatter = P2PAllGather(), P2PReduceScatter()
    cpu = torch.device("cpu")
    failures = []

    def same(name, out, ref, exact=False):
        ok = torch.equal(out, ref) if exact or world == 2 else torch.allclose(out.float(), ref.float(), rtol=1e-2,
                                                                       atol=1e-2)
        if not ok:
            failures.append(f"{name}: max diff {(out.float() - ref.float()).abs().max().item()}")

    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(rank)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            inp = torch.randn(world * N, generator=gen).to(dtype)
            ref = torch.empty(N, dtype=dtype)
            dist.reduce_scatter_tensor(ref, inp.clone(), op=op)
            out = reduce_scatter.allocate((N,), dtype=dtype, device=cpu)
            reduce_scatter(out, inp, dist.group.WORLD, op)
            same(f"reduce_scatter {dtype} {op}", out, ref)
        shard = torch.randn(N, generator=gen).to(dtype)
        ref = torch.empty(world * N, dtype=dtype)
        dist.all_gather_into_tensor(ref, shard)
        out = all_gather.allocate((world * N,), dtype=dtype, device=cpu)
        assert all_gather(out, shard, dist.group.WORLD, async_op=False) is None
        same(f"all_gather {dtype}", out, ref, exact=True)
        # As FSDP does: the input is already the rank's chunk of the output; the gather runs async
        # while a reduce-scatter of another size goes through the same group.
        out2 = all_gather.allocate((world * N,), dtype=dtype, device=cpu)
        out2.view(world, -1)[rank].copy_(shard)
        work = all_gather(out2, out2.view(world, -1)[rank], dist.group.WORLD, async_op=True)
        assert isinstance(work, dist.Work)
        rs_in = torch.randn(world * 77, generator=gen).to(dtype)
        rs_ref = torch.empty(77, dtype=dtype)
        rs_out = torch.empty(77, dtype=dtype)
        reduce_scatter(rs_out, rs_in, dist.group.WORLD, dist.ReduceOp.SUM)
        work.wait()
        dist.reduce_scatter_tensor(rs_ref, rs_in.clone(), op=dist.ReduceOp.SUM)
        same(f"async all_gather {dtype}", out2, ref, exact=True)
        same(f"reduce_scatter during all_gather {dtype}", rs_out, rs_ref)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as fh:
        fh.write("\n".join(failures))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_matches_gloo_collectives(tmp_path, world):
    mp.spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        assert (tmp_path / f"rank{rank}").read_text() == ""
