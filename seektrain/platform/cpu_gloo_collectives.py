"""FSDP2's parameter all-gather and gradient reduce-scatter on gloo, done with point-to-point sends.

gloo's own ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are slow on one host: on 2 CPU
ranks (1 thread each) a 40 MB bf16 all-gather took 61 ms where every rank sending its shard straight to
every other rank (``isend``/``irecv``, all in flight at once) took 17 ms, and an 80 MB fp32
reduce-scatter took 129 ms where sending each rank its chunk and summing locally took 69 ms. The bytes
moved are the same. An earlier version used ``all_to_all_single`` for the reduce-scatter (1.24-1.33x);
point-to-point is faster again (``benchmarks/bench_gloo_collectives.py``).

Both plug into FSDP2 through its public hooks ``set_custom_all_gather`` / ``set_custom_reduce_scatter``,
so FSDP keeps doing everything else (copy-in, copy-out, sharded gradients, HSDP all-reduce). NCCL keeps
its own collectives. Results: the all-gather is a copy, so bit-identical; the reduce-scatter sums the
chunks in rank order in the reduce dtype's compute precision, so on 2 ranks it is bit-identical to
gloo's (``a + b`` rounded once); on more ranks it may differ from gloo's order in the last bit.

Under bf16 (or fp16) compute with fp32 gradient reduction, FSDP's fp32 reduce buffer is a copy of
low-precision gradients, so the reduce-scatter sends those chunks in the low-precision dtype (half the
bytes) and sums them in fp32: the same bits as sending fp32 (``P2PReduceScatter(wire_dtype=...)``).

The point-to-point messages carry their own tags, so an all-gather prefetch still in flight never
matches a reduce-scatter's message; every rank issues FSDP's collectives in the same order, which is
what gloo's per-(peer, tag) ordering needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

_ALL_GATHER_TAG = 7301
_REDUCE_SCATTER_TAG = 7302


def wait(work: dist.Work) -> None:
    """Wait for one gloo request. Its failure (a lost or stuck peer) comes up as a plain ``RuntimeError``
    from this module's frame, so it is raised as torch's ``DistNetworkError``, the type the trainer tells
    a collective failure by (``train/collective_failure.py``)."""
    try:
        work.wait()
    except RuntimeError as err:
        raise dist.DistNetworkError(str(err)) from err


class _Works(dist.Work):
    """One ``Work`` for several point-to-point requests (FSDP waits on a single handle)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            wait(work)
        self._works = []
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _exchange(
    group: dist.ProcessGroup, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], tag: int
) -> list[dist.Work]:
    """Start every send and receive at once (group-local peer ranks); returns their requests."""
    works = [dist.irecv(buf, group=group, group_src=peer, tag=tag) for peer, buf in recvs.items()]
    works += [dist.isend(buf, group=group, group_dst=peer, tag=tag) for peer, buf in sends.items()]
    return works


class P2PAllGather(DefaultAllocMixin, AllGather):
    """``output = cat(input of every rank)``: each rank sends its shard to every other rank."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        chunks = output_tensor.view(world, -1)
        if chunks[rank].data_ptr() != input_tensor.data_ptr():  # FSDP's copy-in already put it there
            chunks[rank].copy_(input_tensor.view(-1))
        peers = [p for p in range(world) if p != rank]
        works = _exchange(
            group, dict.fromkeys(peers, chunks[rank]), {p: chunks[p] for p in peers}, _ALL_GATHER_TAG
        )
        handle = _Works(works)
        if async_op:
            return handle
        handle.wait()
        return None


def _holds_exactly(t: torch.Tensor, dtype: torch.dtype, samples: int = 4096) -> bool:
    """Whether evenly spaced elements of ``t`` survive a round trip through ``dtype``. FSDP's reduce
    buffer is all one kind: a copy of low-precision gradients (every element exact) or fp32 gradients
    accumulated across micro-batches without a reduce (next to none exact)."""
    flat = t.reshape(-1)
    sample = flat[:: max(1, flat.numel() // samples)]
    return torch.equal(sample, sample.to(dtype).to(t.dtype))


class P2PReduceScatter(DefaultAllocMixin, ReduceScatter):
    """``output = sum over ranks of input.chunk(world)[rank]`` (÷ world for AVG).

    With ``wire_dtype`` (bf16 or fp16 compute under an fp32 reduce dtype), chunks whose values are
    exactly ``wire_dtype`` values travel as ``wire_dtype``: FSDP's fp32 reduce buffer is a copy of the
    bf16 gradients, so half its bytes carry no information. The sum is still taken in fp32 over the same
    values, so the result is bit-identical; ``narrow_sends`` counts the calls that took this path.
    """

    def __init__(self, wire_dtype: torch.dtype | None = None):
        super().__init__()
        self.wire_dtype = wire_dtype
        self.narrow_sends = 0

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"point-to-point reduce-scatter supports SUM and AVG, not {op}")
        world, rank = group.size(), group.rank()
        chunks = input_tensor.view(world, -1)
        peers = [p for p in range(world) if p != rank]
        sends = {p: chunks[p] for p in peers}
        wire = self.wire_dtype
        if wire is not None and chunks.dtype == torch.float32 and _holds_exactly(chunks, wire):
            sends = {p: chunk.to(wire) for p, chunk in sends.items()}
            self.narrow_sends += 1
        received = torch.empty(chunks.shape, dtype=sends[peers[0]].dtype) if peers else chunks.clone()
        for work in _exchange(group, sends, {p: received[p] for p in peers}, _REDUCE_SCATTER_TAG):
            wait(work)
        out = output_tensor.view(-1)
        if world == 2:  # a + b in the reduce dtype (a narrow operand is widened exactly); 1.4x (fp32) and
            torch.add(chunks[rank], received[peers[0]], out=out)  # 6.7x (bf16) faster than sum on 1 thread
        else:
            received = received.to(chunks.dtype)  # no copy unless the chunks travelled narrow
            received[rank].copy_(chunks[rank])
            torch.sum(received, dim=0, out=out)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def use_p2p_collectives(model: nn.Module, wire_dtype: torch.dtype | None = None) -> int:
    """Give every FSDP unit of ``model`` the point-to-point all-gather and reduce-scatter (``wire_dtype``:
    see ``P2PReduceScatter``); returns how many units took them (a unit with several parameter meshes
    keeps FSDP's own)."""
    all_gather, reduce_scatter = P2PAllGather(), P2PReduceScatter(wire_dtype)
    taken = 0
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        try:
            unit.set_custom_all_gather(all_gather)
            unit.set_custom_reduce_scatter(reduce_scatter)
            taken += 1
        except ValueError:
            pass
    return taken
