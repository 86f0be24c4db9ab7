"""Tokenize input files once into memory-mappable shards plus a manifest (``seektrain data prepare``).

Tokenizing at training time would cost every rank CPU on every run; a prepared directory is read with
``np.memmap`` at no cost. Everything is written into a temporary sibling directory that is renamed into
place only when complete, so an interrupted run leaves no half dataset behind and a reader (or a
second preparer) sees either nothing or the finished result.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from seektrain.data.blocks import BLOCK_TOKENS, SUFFIX, BlockSums, write_sums
from seektrain.data.chat_template import load_chat_template
from seektrain.data.manifest import (
    MANIFEST_NAME,
    SPLITS,
    Manifest,
    Shard,
    Split,
    TokenizerInfo,
    write_manifest,
)
from seektrain.data.mix import interleave, parse_inputs
from seektrain.data.row_formats import CHAT_KINDS, ROW_KINDS
from seektrain.data.row_mapping import RowMapping
from seektrain.data.rows import RowEncoder
from seektrain.data.sources import discover, read_documents, read_records, row_kind
from seektrain.data.tokenizer import Tokenizer, load_tokenizer
from seektrain.errors import UserError, user_path

_OUR_FILES = re.compile(r"(shard|val)-(\d{5}\.(bin|mask)(\.crc)?|ends\.bin)|\.manifest-.*\.tmp")
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB per uint16 shard: few files, each well under any filesystem limit
_BATCH_CHARS = 4 << 20  # documents handed to the tokenizer at once (HF encode_batch runs on Rust threads)


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def is_val_document(index: int, val_fraction: float) -> bool:
    """Document ``index`` goes to validation when floor((i+1)·f) > floor(i·f).

    Exactly floor(N·f) documents are held out, spread evenly through the input order, and the rule
    needs no knowledge of N, so it works while streaming. Training is never starved when f < 1.
    """
    return math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


class ShardWriter:
    """Streams tokens into ``{prefix}-00000.bin``, ``{prefix}-00001.bin``, ... hashing as it goes: the
    sha256 of each shard, and the CRC-32 of each of its blocks into ``{shard}.crc`` (``blocks.py``)."""

    def __init__(
        self, directory: Path, prefix: str, dtype: np.dtype, shard_tokens: int, suffix: str = ".bin"
    ) -> None:
        self.directory, self.prefix, self.dtype, self.shard_tokens = directory, prefix, dtype, shard_tokens
        self.suffix = suffix
        self.shards: list[Shard] = []
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._sums = BlockSums(BLOCK_TOKENS * dtype.itemsize)
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                name = f"{self.prefix}-{len(self.shards):05d}{self.suffix}"
                self._file = open(self.directory / name, "wb")
                self._hash, self._count = hashlib.sha256(), 0
                self._sums = BlockSums(BLOCK_TOKENS * self.dtype.itemsize)
            take = min(tokens.size, self.shard_tokens - self._count)
            data = tokens[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._sums.update(data)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = Path(self._file.name).name
        sums = self._sums.finish()
        data = write_sums(self.directory / (name + SUFFIX), sums)
        blocks = Shard(name + SUFFIX, sums.size, hashlib.sha256(data).hexdigest())
        self.shards.append(Shard(name, self._count, self._hash.hexdigest(), blocks))
        self._file = None

    def close(self) -> list[Shard]:
        if self._file is not None:
            self._finish()
        return self.shards


def prepare_dataset(
    inputs: Sequence[str | Path],
    output: str | Path,
    tokenizer_spec: str = "byte",
    *,
    fmt: str = "auto",
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = 0.01,
    max_tokens: int | None = None,
    force: bool = False,
    rows: RowOptions | None = None,
) -> Manifest:
    """Tokenize ``inputs`` into ``output`` and return its manifest.

    Each non-empty text document is followed by the tokenizer's eos; chat and completion rows become
    one document each with a loss mask (``rows.py``). An input ``PATH:WEIGHT`` mixes the inputs by
    weight (``mix.py``). ``max_tokens`` stops after the first document that reaches the cap
    (deterministic for the same inputs). ``force`` replaces an existing prepared directory; without it
    an existing non-empty ``output`` is an error.
    """
    rows = rows or RowOptions()
    if rows.overlong not in OVERLONG:
        raise UserError(f"--overlong {rows.overlong}: unknown; use one of {', '.join(OVERLONG)}")
    if rows.max_len is not None and rows.max_len < 2:
        raise UserError(f"--max-len {rows.max_len}: must be at least 2 tokens")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens {shard_tokens}: must be a positive number of tokens")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction}: must be in [0, 1), e.g. 0.01")
    output = Path(output).expanduser()
    paths, weights = parse_inputs(inputs)
    _check_output(output, force, paths)
    groups = [discover([p], fmt) for p in paths] if weights else [discover(paths, fmt)]
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = dtype_for(tokenizer.vocab_size)

    with user_path(f"--output {output}"):
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        forced = fmt if fmt in ROW_KINDS[1:] else None
        manifest = _tokenize_into(
            tmp,
            groups,
            weights,
            tokenizer,
            dtype,
            text_field,
            shard_tokens,
            val_fraction,
            max_tokens,
            forced,
            rows,
        )
        write_manifest(tmp, manifest)
        _commit(tmp, output, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _check_output(output: Path, force: bool, inputs: Sequence[str | Path]) -> None:
    """``--force`` replaces only a folder this command made: our manifest and shards, nothing else, and
    never one holding (or inside) an input. Anything else in the way is refused, whatever the flags."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output}: exists and is a file; choose a directory path")
    resolved = output.resolve()
    for raw in inputs:
        src = Path(raw).expanduser().resolve()
        if src == resolved or resolved in src.parents:
            raise UserError(
                f"--output {output}: holds --input {raw}; write the dataset to a new folder, the "
                "inputs are never replaced"
            )
    if not output.is_dir() or not any(output.iterdir()):
        return
    ours = (output / MANIFEST_NAME).is_file()
    if ours and not force:
        raise UserError(
            f"--output {output}: already a prepared dataset; pass --force to overwrite or choose another --output"
        )
    if not ours:
        raise UserError(
            f"--output {output}: exists and is not empty, and is not a folder made by `seektrain data "
            "prepare` (no manifest.json), so --force will not replace it; choose a new directory"
        )
    foreign = sorted(p.name for p in output.iterdir() if not _made_by_prepare(p))
    if foreign:
        raise UserError(
            f"--output {output}: holds {foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
            "which `seektrain data prepare` did not write, so --force will not replace the folder; move "
            "it out or choose a new directory"
        )


def _made_by_prepare(path: Path) -> bool:
    """manifest.json, shard/val-NNNNN.bin and .mask (and their .crc), shard/val-ends.bin, or a manifest
    temp file: nothing a user keeps."""
    return path.is_file() and (path.name == MANIFEST_NAME or bool(_OUR_FILES.fullmatch(path.name)))


def _commit(tmp: Path, output: Path, force: bool) -> None:
    """Rename the finished temp dir into place; with force the old one is moved aside first."""
    old: Path | None = None
    if output.is_dir():
        if force and any(output.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            os.replace(output, old / "data")
        else:
            output.rmdir()  # empty directory: fails (loudly) if someone filled it meanwhile
    os.rename(tmp, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


OVERLONG = ("drop", "truncate")


@dataclass
class RowOptions:
    """How chat/completion rows become documents (``--chat-template``, ``--train-on``) and what happens
    to a document longer than ``max_len`` tokens (``--overlong``); counted in the manifest's ``rows``."""

    chat_template: str | None = None
    train_on: str = "assistant"
    max_len: int | None = None
    overlong: str = "drop"
    mapping: RowMapping = field(default_factory=RowMapping)  # --columns, --roles


class _Splits:
    """The shard writers of both splits and what they have taken: documents, tokens, trained tokens,
    where each document ends, and the documents dropped or truncated for length."""

    def __init__(
        self,
        directory: Path,
        dtype: np.dtype,
        shard_tokens: int,
        masked: bool,
        rows: RowOptions,
        val_fraction: float,
    ) -> None:
        self.writers = {
            "train": ShardWriter(directory, "shard", dtype, shard_tokens),
            "val": ShardWriter(directory, "val", dtype, shard_tokens),
        }
        self.masks = (
            {
                name: ShardWriter(
                    directory,
                    "shard" if name == "train" else "val",
                    np.dtype("u1"),
                    shard_tokens,
                    suffix=".mask",
                )
                for name in SPLITS
            }
            if masked
            else None
        )
        self.counts = {name: [0, 0, 0] for name in SPLITS}  # documents, tokens, trained tokens
        self.ends: dict[str, list[int]] = {name: [] for name in SPLITS}
        self.rows, self.val_fraction = rows, val_fraction
        self.dropped = self.truncated = self.index = 0

    @property
    def tokens(self) -> int:
        return self.counts["train"][1] + self.counts["val"][1]

    def add(self, ids: list[int], mask: list[int] | None, source: dict[str, Any]) -> None:
        """Append one document (``mask`` None = all trained) unless it is too long to keep."""
        limit = self.rows.max_len
        if limit is not None and len(ids) > limit:
            if self.rows.overlong == "drop" or (mask is not None and not any(mask[:limit])):
                self.dropped += 1
                return
            ids, mask, self.truncated = (
                ids[:limit],
                None if mask is None else mask[:limit],
                self.truncated + 1,
            )
        split = "val" if is_val_document(self.index, self.val_fraction) else "train"
        self.index += 1
        self.writers[split].write(np.asarray(ids, dtype=np.int64))
        trained = len(ids) if mask is None else sum(mask)
        if self.masks is not None:
            self.masks[split].write(
                np.ones(len(ids), np.uint8) if mask is None else np.asarray(mask, np.uint8)
            )
        count = self.counts[split]
        count[0], count[1], count[2] = count[0] + 1, count[1] + len(ids), count[2] + trained
        self.ends[split].append(count[1])
        source["documents"] += 1
        source["tokens"] += len(ids)

    def split(self, name: str, directory: Path) -> Split:
        documents, tokens, trained = self.counts[name]
        ends = _write_ends(directory / f"{'shard' if name == 'train' else 'val'}-ends.bin", self.ends[name])
        masks = self.masks[name].close() if self.masks is not None else []
        return Split(
            self.writers[name].close(),
            tokens,
            documents,
            masks,
            ends,
            trained if self.masks is not None else None,
        )


def _write_ends(path: Path, ends: list[int]) -> Shard:
    data = np.asarray(ends, dtype="<i8").tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return Shard(path.name, len(ends), hashlib.sha256(data).hexdigest())


def _tokenize_into(
    directory: Path,
    groups: list[list[tuple[Path, str]]],
    weights: list[float] | None,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    text_field: str,
    shard_tokens: int,
    val_fraction: float,
    max_tokens: int | None,
    forced_rows: str | None,
    rows: RowOptions,
) -> Manifest:
    """Every input's documents into the shards: the groups one after the other, or mixed by ``weights``."""
    kinds = [
        [row_kind(path, kind, text_field, forced_rows, rows.mapping) for path, kind in g] for g in groups
    ]
    flat = [k for g in kinds for k in g]
    masked = any(k != "text" for k in flat)
    template = None
    if any(k in CHAT_KINDS for k in flat):
        template = load_chat_template(tokenizer.path or tokenizer.spec, rows.chat_template, tokenizer)
    encoder = RowEncoder(tokenizer, template, rows.train_on, rows.mapping, text_field)
    out = _Splits(directory, dtype, shard_tokens, masked, rows, val_fraction)
    sources: list[dict[str, Any]] = []
    streams = []
    for n, (files, group_kinds) in enumerate(zip(groups, kinds)):
        group = []
        for (path, kind), rows_kind in zip(files, group_kinds):
            source: dict[str, Any] = {"path": str(path), "format": kind, "documents": 0, "tokens": 0}
            if rows_kind != "text":
                source["rows"] = rows_kind
            if weights:
                source["weight"] = weights[n]
            sources.append(source)
            group.append((path, kind, rows_kind, source))
        streams.append(_group_documents(group, tokenizer, encoder, text_field, rows.mapping))
    documents = interleave(streams, weights) if weights else (d for s in streams for d in s)
    for ids, mask, source in documents:
        out.add(ids, mask, source)
        if max_tokens is not None and out.tokens >= max_tokens:
            break

    n_files = sum(len(g) for g in groups)
    if out.counts["train"][1] == 0:
        dropped = (
            f"; {out.dropped} documents were longer than --max-len {rows.max_len}" if out.dropped else ""
        )
        raise UserError(
            f"inputs ({n_files} files) contain no text{dropped}; pass files with non-empty "
            "documents (check --text-field)"
        )
    info = TokenizerInfo(
        tokenizer.spec, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id, tokenizer.fingerprint
    )
    row_info: dict[str, Any] = {}
    if masked or rows.max_len is not None:
        row_info = {
            "max_len": rows.max_len,
            "overlong": rows.overlong,
            "dropped": out.dropped,
            "truncated": out.truncated,
        }
    if masked:
        row_info = {"template": template.origin if template else None, "train_on": rows.train_on, **row_info}
    return Manifest(
        tokenizer=info,
        dtype=dtype.name,
        train=out.split("train", directory),
        val=out.split("val", directory),
        val_fraction=val_fraction,
        sources=sources,
        rows=row_info,
    )


_Document = tuple[list[int], "list[int] | None", dict[str, Any]]


def _group_documents(
    group: list[tuple[Path, str, str, dict[str, Any]]],
    tokenizer: Tokenizer,
    encoder: RowEncoder,
    text_field: str,
    mapping: RowMapping,
) -> Iterator[_Document]:
    """``(ids, mask, source)`` for every document of one input's files, in order; text documents are
    tokenized in batches (HF ``encode_batch`` runs on Rust threads), rows one by one."""
    for path, kind, rows_kind, source in group:
        if rows_kind != "text":
            for where, record in read_records(path, kind):
                ids, mask = encoder.encode(rows_kind, where, record)
                yield ids, mask, source
            continue
        batch: list[str] = []
        chars = 0
        for text in read_documents(path, kind, text_field, mapping):
            if not text:
                continue
            batch.append(text)
            chars += len(text)
            if chars >= _BATCH_CHARS:
                yield from _encoded(tokenizer, batch, source)
                batch, chars = [], 0
        yield from _encoded(tokenizer, batch, source)


def _encoded(tokenizer: Tokenizer, batch: list[str], source: dict[str, Any]) -> Iterator[_Document]:
    for ids in tokenizer.encode_batch(batch) if batch else []:
        yield ids + [tokenizer.eos_id], None, source
