"""The point-to-point all-gather and reduce-scatter FSDP uses on gloo give what gloo's own collectives
give, on real gloo processes: bit-identical on 2 ranks (SUM and AVG, fp32 and bf16, sizes that are not
powers of two), equal within rounding on 3 ranks, and an async all-gather overlapping a reduce-scatter
on the same group keeps their messages apart. The reduce-scatter that sends bf16-exact fp32 chunks as
bf16 gives the fp32 path's bits exactly, and sends fp32 when the values need it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from seektrain.platform.cpu_gloo_collectives import P2PAllGather, P2PReduceScatter
from spawn_ranks import spawn_ranks

N = 1003


def _worker(rank: int, out_dir: str) -> None:
    world = dist.get_world_size()
    all_gather, reduce_scatter = P2PAllGather(), P2PReduceScatter()
    cpu = torch.device("cpu")
    failures = []

    def same(name, out, ref, exact=False):
        ok = (
            torch.equal(out, ref)
            if exact or world == 2
            else torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
        )
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
    # bf16 gradients in FSDP's fp32 reduce buffer travel as bf16 and sum to the same fp32 bits; fp32
    # values that bf16 cannot hold go as fp32
    narrow = P2PReduceScatter(wire_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(10 + rank)
    for values, narrow_expected in (("bf16-exact", 1), ("fp32", 0)):
        inp = torch.randn(world * N, generator=gen)
        if values == "bf16-exact":
            inp = inp.bfloat16().float()
        ref = torch.empty(N)
        reduce_scatter(ref, inp, dist.group.WORLD, dist.ReduceOp.AVG)
        out = torch.empty(N)
        before = narrow.narrow_sends
        narrow(out, inp, dist.group.WORLD, dist.ReduceOp.AVG)
        same(f"narrow-wire reduce_scatter, {values} input", out, ref, exact=True)
        if narrow.narrow_sends - before != narrow_expected:
            failures.append(
                f"{values} input: {narrow.narrow_sends - before} narrow sends, want {narrow_expected}"
            )
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as fh:
        fh.write("\n".join(failures))


@pytest.mark.parametrize("world", [2, 3])
def test_matches_gloo_collectives(tmp_path, world):
    spawn_ranks(_worker, world, str(tmp_path))
    for rank in range(world):
        assert (tmp_path / f"rank{rank}").read_text() == ""


def _fsdp_bf16_worker(rank: int, out_dir: str) -> None:
    """One bf16 FSDP forward+backward of tiny-v3 with the narrow wire on or off; writes the sharded
    gradients and how many reduce-scatters went narrow."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from seektrain.models import build_model, get_preset
    from seektrain.parallel.data_parallel import apply_fsdp
    from seektrain.platform import policy_for

    mesh = init_device_mesh("cpu", (2,))
    cfg = get_preset("tiny-v3")
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    grads = {}
    platform, mp = policy_for(torch.device("cpu")), MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    for narrow in (True, False):  # as training shards a model part: apply_fsdp, then the policy's collectives
        model = apply_fsdp(
            build_model(cfg, seed=0, kernels=platform.model_kernels()), mesh, mp, reshard_after_forward=True
        )
        platform.configure_fsdp(model, mp)
        rs = next(m for m in model.modules() if isinstance(m, FSDPModule))._get_fsdp_state()._fsdp_param_group
        comm = rs._reduce_scatter_comm
        if not narrow:
            comm.wire_dtype = None
        model(tokens, labels=tokens).loss_sum.backward()
        grads[narrow] = {
            n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        grads[f"sends{narrow}"] = comm.narrow_sends
    torch.save(grads, os.path.join(out_dir, f"grads{rank}.pt"))


def test_fsdp_bf16_gradients_travel_narrow_and_stay_bit_identical(tmp_path):
    spawn_ranks(_fsdp_bf16_worker, 2, str(tmp_path))
    for rank in range(2):
        grads = torch.load(tmp_path / f"grads{rank}.pt")
        assert grads["sendsTrue"] > 0 and grads["sendsFalse"] == 0
        assert grads[True].keys() == grads[False].keys() and grads[True]
        for name in grads[True]:
            assert torch.equal(grads[True][name], grads[False][name]), name
