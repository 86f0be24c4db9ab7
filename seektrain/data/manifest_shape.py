"""The shape check of a ``manifest.json``: every field present with its type and a sane value, so a
hand-edited or foreign file fails with one line naming the file and the field, never a traceback later.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from seektrain.data.blocks import SUFFIX, blocks_of
from seektrain.errors import UserError

DTYPES = ("uint16", "uint32")  # what data prepare writes (little-endian, no header)
_SHARD_NAME = re.compile(r"(shard|val)-\d{5}\.bin")
_MASK_NAME = re.compile(r"(shard|val)-\d{5}\.mask")
_ENDS_NAME = re.compile(r"(shard|val)-ends\.bin")


class _Bad(ValueError):
    pass


def check_manifest_shape(d: Any, path: Path) -> None:
    """Raise ValueError('{path}: field X ...; re-run ...') for the first field of the wrong shape."""
    try:
        _check(d)
    except _Bad as bad:
        raise UserError(f"{path}: {bad}; re-run `seektrain data prepare ... --force` to rebuild it") from None


def _check(d: Any) -> None:
    _need(isinstance(d, dict), "", "must be a JSON object")
    tok = _field(d, "tokenizer", dict)
    _field(tok, "spec", str, "tokenizer.")
    vocab = _count(tok, "vocab_size", "tokenizer.", low=1)
    eos = _count(tok, "eos_id", "tokenizer.")
    _need(eos < vocab, "tokenizer.eos_id", f"{eos} is not below vocab_size {vocab}")
    bos = tok.get("bos_id")
    _need(
        bos is None or (type(bos) is int and 0 <= bos < vocab),
        "tokenizer.bos_id",
        f"{bos!r} is not null or a token id",
    )
    _field(tok, "fingerprint", str, "tokenizer.")
    dtype = _field(d, "dtype", str)
    _need(dtype in DTYPES, "dtype", f"{dtype!r} is unknown; expected one of {', '.join(DTYPES)}")
    _need(
        vocab <= (1 << 16 if dtype == "uint16" else 1 << 32),
        "dtype",
        f"{dtype} cannot hold vocab_size {vocab}",
    )
    block = d.get("block_tokens")
    _need(
        block is None or (type(block) is int and block >= 1), "block_tokens", f"{block!r} is not null or >= 1"
    )
    for split in ("train", "val"):
        s = _field(d, split, dict)
        shards = _field(s, "shards", list, f"{split}.")
        total = 0
        for i, shard in enumerate(shards):
            total += _shard(shard, f"{split}.shards[{i}]", _SHARD_NAME, block)
        tokens = _count(s, "tokens", f"{split}.")
        _need(tokens == total, f"{split}.tokens", f"{tokens} is not the sum of its shards' tokens ({total})")
        documents = _count(s, "documents", f"{split}.")
        masks = s.get("mask", [])
        _need(isinstance(masks, list), f"{split}.mask", "must be a list")
        _need(
            masks == []
            or [m.get("tokens") if isinstance(m, dict) else None for m in masks]
            == [x.get("tokens") for x in shards],
            f"{split}.mask",
            "does not match its token shards one for one",
        )
        for i, shard in enumerate(masks):
            _shard(shard, f"{split}.mask[{i}]", _MASK_NAME, block)
        if s.get("ends") is not None:
            _need(
                _shard(s["ends"], f"{split}.ends", _ENDS_NAME) == documents,
                f"{split}.ends.tokens",
                f"is not the number of documents ({documents})",
            )
        trained = s.get("trained_tokens")
        _need(
            trained is None or (type(trained) is int and 0 <= trained <= tokens),
            f"{split}.trained_tokens",
            f"{trained!r} is not null or a count of at most {tokens}",
        )
    frac = d.get("val_fraction")
    _need(type(frac) in (int, float) and 0 <= frac < 1, "val_fraction", f"{frac!r} is not a number in [0, 1)")
    _need(isinstance(d.get("sources", []), list), "sources", "must be a list")
    _need(isinstance(d.get("rows", {}), dict), "rows", "must be a JSON object")


def _shard(shard: Any, where: str, pattern: re.Pattern, block: int | None = None) -> int:
    """Check one {file, tokens, sha256[, blocks]} entry (``blocks``: its checksum file, one per
    ``block`` elements); returns its count."""
    _need(isinstance(shard, dict), where, "must be an object with file, tokens, sha256")
    name = _field(shard, "file", str, where + ".")
    _need(bool(pattern.fullmatch(name)), where + ".file", f"{name!r} is not a file name of this folder")
    count = _count(shard, "tokens", where + ".")
    sha = _field(shard, "sha256", str, where + ".")
    _need(bool(re.fullmatch(r"[0-9a-f]{64}", sha)), where + ".sha256", "is not a sha256 hex digest")
    sums = shard.get("blocks")
    if sums is not None:
        _need(block is not None, where + ".blocks", "is given but the manifest has no block_tokens")
        assert block is not None
        blocks = _shard(sums, where + ".blocks", re.compile(re.escape(name + SUFFIX)))
        _need(
            blocks == blocks_of(count, block),
            where + ".blocks.tokens",
            f"is not the number of blocks ({blocks_of(count, block)})",
        )
    return count


def _need(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise _Bad(f"field {field!r} {problem}" if field else problem)


def _field(d: dict, key: str, typ: type, prefix: str = "") -> Any:
    _need(key in d, prefix + key, "is missing")
    _need(
        isinstance(d[key], typ) and not isinstance(d[key], bool),
        prefix + key,
        f"must be a {'JSON object' if typ is dict else typ.__name__}, got {type(d[key]).__name__}",
    )
    return d[key]


def _count(d: dict, key: str, prefix: str = "", low: int = 0) -> int:
    _need(key in d, prefix + key, "is missing")
    value = d[key]
    _need(type(value) is int and value >= low, prefix + key, f"must be an integer >= {low}, got {value!r}")
    return value
