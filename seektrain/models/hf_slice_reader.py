"""Fill a materialised, possibly sharded module from a Hugging Face folder, each rank reading only the
bytes of the slices it holds, straight into its local tensors, in their dtype.

The model family says which stored tensor slices make up a box of one of its tensors (``WeightSource``,
e.g. ``models/deepseek/hf_folder.py``); this module does the reading: given every local tensor's box
(``whole_shards`` for a plain model, ``checkpoint/local_shards.py`` for a sharded one), the family's
reads are split into chunks of at most ``CHUNK_BYTES`` (fp32-sized) along their first dimension, and a
few threads ``pread`` them (``safetensors_slices.py``). FP8 block-scaled weights (DeepSeek-V3's
release) are dequantised chunk by chunk with just the scale blocks the chunk touches: the same
arithmetic as a whole-tensor dequantisation, element for element.

Memory while loading: the rank's own shards (allocated before, by ``to_empty``) plus, per thread, one
chunk in the file's dtype, its fp32 form and its scale (about ``3 * CHUNK_BYTES``): at the default
4 threads, under 200 MiB whatever the model's size.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from seektrain.models.safetensors_slices import HFWeightsError, TensorInfo, read_box

CHUNK_BYTES = 16 * 2**20  # one read, as fp32 elements
DEFAULT_THREADS = 4
# per thread: a chunk in the file's dtype (at most fp32-sized), its fp32 form and its expanded FP8 scale
PEAK_BUFFER_BYTES = DEFAULT_THREADS * 3 * CHUNK_BYTES


Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LocalShard:
    """``local`` (writes go into the module) is ``box`` of the tensor of shape ``full_shape``: the whole
    of it for a plain model (``whole_shards``), a rank's part of it under a layout
    (``checkpoint/local_shards.py``, which knows DTensors)."""

    name: str
    local: torch.Tensor
    box: Box
    full_shape: tuple[int, ...]


def state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every state-dict entry of ``module`` (parameters and persistent buffers, by their state-dict
    names), each tensor once: a tied weight is listed under its first name only."""
    seen: set[int] = set()
    out = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def whole_shard(name: str, tensor: torch.Tensor) -> LocalShard:
    shape = tuple(tensor.shape)
    return LocalShard(name, tensor.detach(), tuple((0, d) for d in shape), shape)


def whole_shards(module: nn.Module) -> list[LocalShard]:
    """Every tensor of a plain (unsharded) ``module`` as a shard of all of itself."""
    return [whole_shard(name, tensor) for name, tensor in state_tensors(module)]


def row_ranges(rows: int, row_elems: int, limit_bytes: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges over ``rows`` rows of ``row_elems`` elements each, at most ``limit_bytes`` of
    fp32 per range (at least one row): the pieces a tensor is read or written in."""
    step = max(1, limit_bytes // max(4 * row_elems, 1))
    for lo in range(0, rows, step):
        yield lo, min(lo + step, rows)


@dataclass(frozen=True)
class SliceRead:
    """Stored tensor ``key`` of ``file``, its ``box``, goes into ``dest`` of a local tensor (``dest`` may
    have one leading dimension of size 1 more than ``box``: one expert of a fused expert tensor).
    ``scale``: (file, key) of an FP8 weight's block scales (``weight_scale_inv``)."""

    file: str
    key: str
    box: Box
    dest: Box
    scale: tuple[str, str] | None = None


class WeightSource(Protocol):
    """A model folder as the family reads it."""

    path: str
    block: tuple[int, int]  # FP8 scale block (rows, cols)

    def info(self, file: str, key: str) -> TensorInfo: ...

    def reads(self, shard: LocalShard) -> list[SliceRead] | None:
        """The reads that fill ``shard``; None when the folder has no such tensor (e.g. a LoRA adapter)."""
        ...


@dataclass
class LoadReport:
    bytes_read: int = 0
    seconds: float = 0.0
    tensors: int = 0
    threads: int = DEFAULT_THREADS
    not_loaded: list[str] = field(default_factory=list)  # local tensors the folder does not hold

    def describe(self, what: str) -> str:
        rate = self.bytes_read / max(self.seconds, 1e-9) / 1e9
        return (
            f"{what}: read {self.bytes_read / 1e9:.2f} GB into {self.tensors} local tensors in "
            f"{self.seconds:.1f} s ({rate:.2f} GB/s, {self.threads} threads; `seektrain doctor` with this "
            "model.hf_path measures the disk's raw read rate)"
        )


@dataclass(frozen=True)
class _Chunk:
    read: SliceRead
    box: Box  # of the stored tensor
    target: torch.Tensor  # the local view it fills (same shape as the box)


def fill_shards(
    shards: list[LocalShard],
    source: WeightSource,
    threads: int = DEFAULT_THREADS,
    chunk_bytes: int = CHUNK_BYTES,
) -> LoadReport:
    """Fill each shard's ``local`` tensor (its ``box`` of the full tensor) from ``source`` (see the
    module docstring); ``report.not_loaded`` names the shards the folder does not hold, left as they were."""
    start = time.perf_counter()
    report = LoadReport(threads=threads)
    chunks: list[_Chunk] = []
    for shard in shards:
        reads = source.reads(shard)
        if reads is None:
            report.not_loaded.append(shard.name)
            continue
        covered = sum(math.prod(hi - lo for lo, hi in r.dest) for r in reads)
        if covered != shard.local.numel():
            raise HFWeightsError(
                f"{shard.name}: the tensors of {source.path} fill {covered} of the {shard.local.numel()} "
                "elements this rank holds; the folder does not match the model"
            )
        report.tensors += 1
        chunks += _chunks(shard, reads, chunk_bytes)
    files = sorted({c.read.file for c in chunks} | {c.read.scale[0] for c in chunks if c.read.scale})
    fds = {}
    try:
        for file in files:
            fds[file] = _open(os.path.join(source.path, file))
        with torch.no_grad(), ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            report.bytes_read = sum(pool.map(lambda c: _fill(c, source, fds), chunks))
    finally:
        for fd in fds.values():
            os.close(fd)
    report.seconds = time.perf_counter() - start
    return report


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as err:
        raise HFWeightsError(f"{path}: cannot be opened ({err.strerror or err})") from None


def _chunks(shard: LocalShard, reads: list[SliceRead], chunk_bytes: int) -> Iterator[_Chunk]:
    for read in reads:
        target = shard.local[tuple(slice(lo, hi) for lo, hi in read.dest)]
        if target.dim() == len(read.box) + 1:
            target = target.squeeze(0)
        shape = tuple(hi - lo for lo, hi in read.box)
        if not shape:
            yield _Chunk(read, read.box, target)
            continue
        first = read.box[0][0]
        for lo, hi in row_ranges(shape[0], math.prod(shape[1:]), chunk_bytes):
            yield _Chunk(read, ((first + lo, first + hi), *read.box[1:]), target[lo:hi])


def _fill(chunk: _Chunk, source: WeightSource, fds: dict[str, int]) -> int:
    """Read one chunk into its target; returns the bytes read."""
    read = chunk.read
    info = source.info(read.file, read.key)
    path = os.path.join(source.path, read.file)
    value = read_box(fds[read.file], info, chunk.box, path)
    nbytes = value.numel() * value.element_size()
    if read.scale is not None:
        scale, scale_bytes = _scale_for(chunk.box, source, fds, read.scale)
        value = (value.float() * scale).to(chunk.target.dtype)
        nbytes += scale_bytes
    chunk.target.copy_(value.view(chunk.target.shape))
    return nbytes


def _scale_for(box: Box, source: WeightSource, fds: dict[str, int], where: tuple[str, str]):
    """The per-element scale of an FP8 weight's ``box``: the scale blocks it touches, expanded and cut
    to the box (blocks at the tensor's edge may be partial)."""
    (r0, r1), (c0, c1) = box
    b0, b1 = source.block
    file, key = where
    blocks = ((r0 // b0, (r1 - 1) // b0 + 1), (c0 // b1, (c1 - 1) // b1 + 1))
    scale = read_box(fds[file], source.info(file, key), blocks, os.path.join(source.path, file))
    expanded = scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    row0, col0 = r0 - blocks[0][0] * b0, c0 - blocks[1][0] * b1
    return expanded[row0 : row0 + r1 - r0, col0 : col0 + c1 - c0], scale.numel() * scale.element_size()
