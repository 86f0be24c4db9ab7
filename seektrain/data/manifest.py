"""``manifest.json``: the one file that says what a prepared dataset holds.

Shards are raw little-endian integers with no header, so everything needed to read them (dtype, token
counts) and to trust them (sha256, tokenizer fingerprint) lives here. The manifest is written last and
atomically, so a directory either has a complete manifest or is not a prepared dataset.

Version 2 adds, per split, where its documents end (``ends``: one little-endian int64 per document,
the running token count after it) and, for chat and completion data, a loss mask (``mask``: one uint8
per token, 1 = trained, in shards aligned with the token shards), each under its sha256. A version 1
folder (tokens only) still loads: it has neither, so it trains as one token stream.

Version 3 adds, for every token and mask shard, ``blocks``: its ``.crc`` file of one CRC-32 per
``block_tokens`` elements (``blocks.py``), which lets a run check each block it reads. Version 1 and 2
folders still load without them: their sizes are checked when a run starts, but a shard that changes
during the run is not noticed (``seektrain data verify`` still finds it by sha256).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seektrain.data.blocks import BLOCK_TOKENS
from seektrain.data.manifest_shape import check_manifest_shape
from seektrain.errors import UserError

FORMAT = "seektrain-tokens"
VERSION = 3
# version 1: tokens only, no document ends and no mask; version 2: no block checksums
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")


@dataclass
class Shard:
    file: str
    tokens: int
    sha256: str
    # the shard's block checksums (``tokens`` = blocks); None for the ends file and before version 3
    blocks: Shard | None = None

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Shard:
        blocks = d.get("blocks")
        return Shard(d["file"], d["tokens"], d["sha256"], Shard.from_dict(blocks) if blocks else None)


@dataclass
class Split:
    shards: list[Shard] = field(default_factory=list)
    tokens: int = 0
    documents: int = 0
    mask: list[Shard] = field(
        default_factory=list
    )  # uint8 per token, aligned with ``shards``; [] = all trained
    ends: Shard | None = None  # int64 per document (``tokens`` = documents); None in version 1 folders
    trained_tokens: int | None = None  # tokens whose mask is 1 (== tokens without a mask)

    @property
    def trained(self) -> int:
        return self.tokens if self.trained_tokens is None else self.trained_tokens


@dataclass
class TokenizerInfo:
    spec: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    fingerprint: str


@dataclass
class Manifest:
    tokenizer: TokenizerInfo
    dtype: str
    train: Split
    val: Split
    val_fraction: float
    sources: list[dict[str, Any]] = field(default_factory=list)
    # chat/completion data: {"template", "train_on", "max_len", "overlong", "dropped", "truncated"}
    rows: dict[str, Any] = field(default_factory=dict)
    block_tokens: int | None = BLOCK_TOKENS  # elements per checksummed block; None before version 3
    format: str = FORMAT
    version: int = VERSION

    @property
    def has_mask(self) -> bool:
        return bool(self.train.mask or self.val.mask)

    @property
    def total_tokens(self) -> int:
        return self.train.tokens + self.val.tokens

    @property
    def documents(self) -> int:
        return self.train.documents + self.val.documents

    def split(self, name: str) -> Split:
        if name not in SPLITS:
            raise UserError(f"split={name!r}: unknown split; use one of {', '.join(SPLITS)}")
        return self.train if name == "train" else self.val

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # Redundant totals make the file readable by eye and by tools that don't know the layout.
        d["total_tokens"] = self.total_tokens
        d["documents"] = self.documents
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Manifest:
        def split(s: dict[str, Any]) -> Split:
            ends = Shard.from_dict(s["ends"]) if s.get("ends") is not None else None
            return Split(
                [Shard.from_dict(x) for x in s["shards"]],
                s["tokens"],
                s["documents"],
                [Shard.from_dict(x) for x in s.get("mask", [])],
                ends,
                s.get("trained_tokens"),
            )

        return Manifest(
            tokenizer=TokenizerInfo(**d["tokenizer"]),
            dtype=d["dtype"],
            train=split(d["train"]),
            val=split(d["val"]),
            val_fraction=d["val_fraction"],
            sources=d.get("sources", []),
            rows=d.get("rows", {}),
            block_tokens=d.get("block_tokens"),
            format=d["format"],
            version=d["version"],
        )


def read_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise UserError(
            f"data.path={directory}: no such directory; run `seektrain data prepare --input ... "
            f"--output {directory}` first"
        )
    if not path.is_file():
        raise UserError(
            f"data.path={directory}: no manifest.json found; run `seektrain data prepare --input "
            f"... --output {directory}` first"
        )
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(
            f"{path}: not valid JSON ({str(e).splitlines()[0][:200]}); re-run `seektrain data prepare ... --force`"
        ) from None
    if not isinstance(d, dict):
        raise UserError(
            f"{path}: expected a JSON object, got {type(d).__name__}; re-run `seektrain data prepare ... --force`"
        )
    if d.get("format") != FORMAT or d.get("version") not in READABLE_VERSIONS:
        raise UserError(
            f"{path}: format {d.get('format')!r} version {d.get('version')!r} is not {FORMAT!r} version "
            f"{' or '.join(map(str, READABLE_VERSIONS))}; "
            "re-run `seektrain data prepare ... --force` with this seektrain"
        )
    check_manifest_shape(d, path)
    try:
        return Manifest.from_dict(d)
    except (KeyError, TypeError) as e:
        raise UserError(
            f"{path}: malformed manifest (field {e}); re-run `seektrain data prepare ... --force`"
        ) from None


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Write to a temp file in the same directory, fsync, then rename: readers never see half a file."""
    from seektrain.checkpoint.atomic import write_text_atomic

    return write_text_atomic(Path(directory) / MANIFEST_NAME, json.dumps(manifest.to_dict(), indent=2) + "\n")
