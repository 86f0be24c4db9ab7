"""A prepared split seen as one long token array, memory-mapped shard by shard.

Nothing is read into RAM up front: the OS pages in the windows that are asked for. Opening checks
what is cheap (every shard exists and its size matches the manifest); ``verify()`` re-hashes every
byte and is meant for ``seektrain data verify`` and tests, not for every training start.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from seektrain.data.manifest import SPLITS, Manifest, Shard, read_manifest


class TokenDataset:
    def __init__(self, directory: str | Path, split: str = "train") -> None:
        self.directory = Path(directory).expanduser()
        self.manifest: Manifest = read_manifest(self.directory)
        self.split = split
        info = self.manifest.split(split)
        if info.tokens == 0:
            raise ValueError(
                f"data.path={self.directory}: split {split!r} is empty; re-prepare with more documents or a larger --val-fraction"
            )
        self.dtype = np.dtype(self.manifest.dtype).newbyteorder("<")
        self.shards: list[Shard] = info.shards
        self._maps: list[np.memmap] = []
        for shard in self.shards:
            path = self.directory / shard.file
            expected = shard.tokens * self.dtype.itemsize
            if not path.is_file():
                raise ValueError(f"{path}: shard listed in manifest.json is missing; re-run `seektrain data prepare ... --force`")
            if path.stat().st_size != expected:
                raise ValueError(
                    f"{path}: {path.stat().st_size} bytes but manifest says {expected}; the shard is truncated or "
                    "modified, re-run `seektrain data prepare ... --force`"
                )
            self._maps.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(shard.tokens,)))
        counts = np.array([s.tokens for s in self.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        if int(self._starts[-1]) != info.tokens:
            raise ValueError(f"{self.directory}/manifest.json: shard token counts do not add up to {info.tokens}; re-prepare the data")

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream, crossing shard boundaries as needed."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) out of range for {len(self)} tokens")
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while length > 0:
            offset = start - int(self._starts[shard])
            take = min(length, self.shards[shard].tokens - offset)
            pieces.append(self._maps[shard][offset : offset + take])
            start, length, shard = start + take, length - take, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def verify(self) -> None:
        """Full sha256 of every shard of this split; raises ValueError naming the first corrupt shard."""
        for shard in self.shards:
            _check_sha256(self.directory, shard)


def _check_sha256(directory: Path, shard: Shard) -> None:
    h = hashlib.sha256()
    with open(directory / shard.file, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    if h.hexdigest() != shard.sha256:
        raise ValueError(f"{directory / shard.file}: sha256 mismatch, the shard is corrupt or modified; re-run `seektrain data prepare ... --force`")


def verify_dataset(directory: str | Path) -> Manifest:
    """Check sizes and checksums of every shard of every split; returns the manifest if all is well."""
    directory = Path(directory).expanduser()
    manifest = read_manifest(directory)
    for split in SPLITS:
        if manifest.split(split).tokens:
            TokenDataset(directory, split).verify()
    return manifest
