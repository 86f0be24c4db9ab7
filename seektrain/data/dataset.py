"""A prepared split seen as one long token array (plus its loss mask and document ends when the folder
has them), memory-mapped shard by shard.

Nothing is read into RAM up front: the OS pages in the windows that are asked for. Opening checks
what is cheap (every shard exists and its size matches the manifest); ``verify()`` re-hashes every
byte and is meant for ``seektrain data verify`` and tests, not for every training start.

Every read of a folder prepared with block checksums (manifest version 3) is checked block by block
(``blocks.py``), so a shard that changes during a run raises ``ShardDamaged`` before its tokens are
handed out. The document ends, small beside the tokens, are read into memory once and checked against
their sha256 there, so they cannot change under a run either. Older folders get the size check only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from seektrain.data.blocks import CRC_DTYPE, CheckedShard, ShardDamaged
from seektrain.data.manifest import SPLITS, Manifest, Shard, read_manifest
from seektrain.errors import UserError


class TokenDataset:
    """The split's tokens, and where the folder has them, its loss mask and document ends."""

    def __init__(self, directory: str | Path, split: str = "train") -> None:
        self.directory = Path(directory).expanduser()
        self.manifest: Manifest = read_manifest(self.directory)
        self.split = split
        info = self.manifest.split(split)
        if info.tokens == 0:
            raise UserError(
                f"data.path={self.directory}: split {split!r} is empty; re-prepare with more "
                "documents or a larger --val-fraction"
            )
        self.dtype = np.dtype(self.manifest.dtype).newbyteorder("<")
        self.shards: list[Shard] = info.shards
        block = self.manifest.block_tokens
        self._tokens = _ShardStream(self.directory, info.shards, self.dtype, block)
        if self._tokens.total != info.tokens:
            raise UserError(
                f"{self.directory}/manifest.json: shard token counts do not add up to "
                f"{info.tokens}; re-prepare the data"
            )
        self._mask = None
        if info.mask:
            self._mask = _ShardStream(self.directory, info.mask, np.dtype("u1"), block, self._tokens.blocks)
        self.ends: np.ndarray | None = None  # running token count after each document
        self._ends_checked = False
        if info.ends is not None:
            self.ends = _open(self.directory, info.ends, np.dtype("<i8"))
            if info.ends.tokens and int(self.ends[-1]) != info.tokens:
                raise UserError(
                    f"{self.directory / info.ends.file}: document ends do not end at the split's "
                    f"{info.tokens} tokens; re-run `seektrain data prepare ... --force`"
                )

    def __len__(self) -> int:
        return self._tokens.total

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    @property
    def has_mask(self) -> bool:
        return self._mask is not None

    @property
    def block_checked(self) -> bool:
        """Whether every read is checked against block checksums (folders prepared by version 3)."""
        return self._tokens.checked and (self._mask is None or self._mask.checked)

    def damage(self, code: int) -> ShardDamaged:
        """The error for damaged block ``code`` (``ShardDamaged.code``), the same on every rank."""
        for stream in (self._tokens, self._mask):
            if stream is not None and stream.first_code <= code < stream.first_code + stream.blocks:
                return stream.damaged(code)
        raise ValueError(f"block code {code} is not a block of this split")

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream, crossing shard boundaries as needed."""
        return self._tokens.read(start, length)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """Loss mask of tokens [start, start+length): 1 = trained; all ones for data without a mask."""
        if self._mask is None:
            return np.ones(length, dtype=np.uint8)
        return self._mask.read(start, length)

    def document_ends(self) -> np.ndarray:
        """Where each document ends, in memory and checked against their sha256 (so a run's rows and
        document masks cannot change under it); ValueError for a folder prepared before they were stored."""
        if self.ends is None:
            raise UserError(
                f"data.path={self.directory}: prepared by an older seektrain, without document "
                "boundaries; re-run `seektrain data prepare ... --force` (data.packing, "
                "data.document_mask and `data show` need them)"
            )
        if not self._ends_checked:
            info = self.manifest.split(self.split).ends
            assert info is not None
            ends = np.array(self.ends)
            if hashlib.sha256(ends.tobytes()).hexdigest() != info.sha256:
                raise UserError(_sha256_mismatch(self.directory / info.file))
            self.ends, self._ends_checked = ends, True
        return self.ends

    def verify(self) -> None:
        """Full sha256 of every file of this split; raises ValueError naming the first corrupt one."""
        info = self.manifest.split(self.split)
        for shard in info.shards + info.mask + ([info.ends] if info.ends else []):
            _check_sha256(self.directory, shard)
            if shard.blocks is not None:
                _check_sha256(self.directory, shard.blocks)


class _ShardStream:
    """Shards of one element type seen as one array, memory-mapped (sizes checked on opening); with
    ``block_tokens`` and a checksum file for every shard, each read is checked (``CheckedShard``).
    Blocks are numbered over the stream from ``first_code`` (``ShardDamaged.code``)."""

    def __init__(
        self,
        directory: Path,
        shards: list[Shard],
        dtype: np.dtype,
        block_tokens: int | None = None,
        first_code: int = 0,
    ) -> None:
        self.shards = shards
        self._maps = [_open(directory, shard, dtype) for shard in shards]
        self._starts = np.concatenate([[0], np.cumsum([s.tokens for s in shards], dtype=np.int64)])
        self.total = int(self._starts[-1])
        self.checked = block_tokens is not None and all(s.blocks is not None for s in shards)
        self.first_code, self.blocks = first_code, 0
        self._checked: list[CheckedShard] = []
        if self.checked:
            assert block_tokens is not None
            for shard, data in zip(shards, self._maps):
                assert shard.blocks is not None
                sums = _open(directory, shard.blocks, CRC_DTYPE)
                self._checked.append(
                    CheckedShard(directory / shard.file, data, sums, block_tokens, first_code + self.blocks)
                )
                self.blocks += shard.blocks.tokens

    def damaged(self, code: int) -> ShardDamaged:
        """The error for block ``code`` of this stream."""
        shard = next(s for s in reversed(self._checked) if s.first_code <= code)
        return shard.damaged(code - shard.first_code)

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > self.total:
            raise IndexError(f"tokens [{start}, {start + length}) out of range for {self.total} tokens")
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while length > 0:
            offset = start - int(self._starts[shard])
            take = min(length, self.shards[shard].tokens - offset)
            if self.checked:
                pieces.append(self._checked[shard].read(offset, take))
            else:
                pieces.append(self._maps[shard][offset : offset + take])
            start, length, shard = start + take, length - take, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _open(directory: Path, shard: Shard, dtype: np.dtype) -> np.memmap:
    path = directory / shard.file
    expected = shard.tokens * dtype.itemsize
    if not path.is_file():
        raise UserError(
            f"{path}: shard listed in manifest.json is missing; re-run `seektrain data prepare ... --force`"
        )
    if path.stat().st_size != expected:
        raise UserError(
            f"{path}: {path.stat().st_size} bytes but manifest says {expected}; the shard is truncated or "
            "modified, re-run `seektrain data prepare ... --force`"
        )
    return np.memmap(path, dtype=dtype, mode="r", shape=(shard.tokens,))


def _check_sha256(directory: Path, shard: Shard) -> None:
    h = hashlib.sha256()
    with open(directory / shard.file, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    if h.hexdigest() != shard.sha256:
        raise UserError(_sha256_mismatch(directory / shard.file))


def _sha256_mismatch(path: Path) -> str:
    return f"{path}: sha256 mismatch, the shard is corrupt or modified; re-run `seektrain data prepare ... --force`"


def verify_dataset(directory: str | Path) -> Manifest:
    """Check sizes and checksums of every shard of every split; returns the manifest if all is well."""
    directory = Path(directory).expanduser()
    manifest = read_manifest(directory)
    for split in SPLITS:
        if manifest.split(split).tokens:
            TokenDataset(directory, split).verify()
    return manifest
