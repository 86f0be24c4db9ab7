"""Per-block CRC-32 of shard files: how a run notices a shard that changed *after* it was prepared.

Why blocks and not the shard's sha256: a training read is one window (a few KiB) of a shard that may be
hundreds of MiB, and hashing the whole shard for every window, or once at start-up, either costs far
too much or says nothing about the bytes read an hour later (a failing disk, a second `data prepare`
writing into the folder, a network filesystem returning garbage). So ``data prepare`` also writes, for
every shard ``X``, a file ``X.crc``: one little-endian uint32 CRC-32 (``zlib.crc32``) per block of
``block_tokens`` elements, blocks counted from the shard's first byte, the last one shorter. A read
copies the whole blocks it touches out of the shard, checks them, and hands out only that checked copy,
so the bytes that reach a step are the bytes that were checked. Reading whole blocks costs at most one
block more than the window on either side (the default block is 8192 elements: 16 KiB of uint16
tokens), and ``benchmarks/bench_data_checksum.py`` measures it.

The ``.crc`` file is memory-mapped too, so a damaged checksum file reads as a damaged block: the run
stops, which is the safe side. Its sha256 is in the manifest for ``seektrain data verify``.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from seektrain.errors import UserError

BLOCK_TOKENS = 1 << 13  # elements per block: 16 KiB of uint16 tokens, 32 KiB of uint32, 8 KiB of mask
SUFFIX = ".crc"
CRC_DTYPE = np.dtype("<u4")


class ShardDamaged(UserError):
    """A block of a shard no longer matches its checksum. ``code`` numbers the block within its dataset
    split (``TokenDataset.damage``), so ranks can agree on the first damaged block by a MIN all-reduce
    and all print the same line."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def damage_message(path: Path, block: int, lo: int, hi: int) -> str:
    return (
        f"{path}: block {block} (bytes {lo}-{hi - 1}) does not match its checksum in {path.name}{SUFFIX}: "
        "the file changed after `seektrain data prepare` wrote it (a failing disk, another writer, a "
        "network filesystem) and none of that block was used; restore the file or re-run `seektrain data "
        "prepare ... --force` with the same inputs, then run the same command again (training resumes "
        "from its last checkpoint)"
    )


class BlockSums:
    """The CRC-32 of each ``block_bytes`` block of a byte stream that arrives in pieces of any size."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.sums: list[int] = []
        self._crc = 0
        self._filled = 0  # bytes of the current (unfinished) block

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._filled)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == self.block_bytes:
                self._close_block()

    def _close_block(self) -> None:
        self.sums.append(self._crc)
        self._crc, self._filled = 0, 0

    def finish(self) -> np.ndarray:
        """The sums of all blocks (a short last block included); the stream ends here."""
        if self._filled:
            self._close_block()
        return np.asarray(self.sums, dtype=CRC_DTYPE)


def write_sums(path: Path, sums: np.ndarray) -> bytes:
    """Write ``sums`` to ``path`` (fsynced); returns the bytes written, for the manifest's sha256."""
    data = sums.astype(CRC_DTYPE, copy=False).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def blocks_of(elements: int, block_tokens: int) -> int:
    return -(-elements // block_tokens)


class CheckedShard:
    """One memory-mapped shard whose reads are checked block by block against its ``.crc`` file."""

    def __init__(self, path: Path, data: np.memmap, sums: np.memmap, block_tokens: int, first_code: int):
        self.path, self.data, self.sums = path, data, sums
        self.block = block_tokens
        self.first_code = first_code  # the split-wide number of this shard's block 0

    def read(self, offset: int, length: int) -> np.ndarray:
        """Elements [offset, offset+length) from a copy of the blocks holding them, each checked."""
        first, last = offset // self.block, (offset + length - 1) // self.block
        lo = first * self.block
        copy = np.array(self.data[lo : min((last + 1) * self.block, self.data.size)])
        for b in range(first, last + 1):
            part = copy[(b - first) * self.block : (b - first + 1) * self.block]
            if zlib.crc32(part.data) != int(self.sums[b]):
                raise self.damaged(b)
        return copy[offset - lo : offset - lo + length]

    def damaged(self, block: int) -> ShardDamaged:
        size = self.data.itemsize
        lo = block * self.block * size
        hi = min((block + 1) * self.block, self.data.size) * size
        return ShardDamaged(damage_message(self.path, block, lo, hi), self.first_code + block)
