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
from pathlib import Path
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np

from seektrain.data.manifest import MANIFEST_NAME, Manifest, Shard, Split, TokenizerInfo, write_manifest
from seektrain.data.sources import discover, read_documents
from seektrain.data.tokenizer import Tokenizer, load_tokenizer

_OUR_FILES = re.compile(r"(shard|val)-\d{5}\.bin|\.manifest-.*\.tmp")
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
    """Streams tokens into ``{prefix}-00000.bin``, ``{prefix}-00001.bin``, ... hashing as it goes."""

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.prefix, self.dtype, self.shard_tokens = directory, prefix, dtype, shard_tokens
        self.shards: list[Shard] = []
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                name = f"{self.prefix}-{len(self.shards):05d}.bin"
                self._file = open(self.directory / name, "wb")
                self._hash, self._count = hashlib.sha256(), 0
            take = min(tokens.size, self.shard_tokens - self._count)
            data = tokens[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards.append(Shard(Path(self._file.name).name, self._count, self._hash.hexdigest()))
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
) -> Manifest:
    """Tokenize ``inputs`` into ``output`` and return its manifest.

    Each non-empty document is followed by the tokenizer's eos. ``max_tokens`` stops after the first
    document that reaches the cap (deterministic for the same inputs). ``force`` replaces an existing
    prepared directory; without it an existing non-empty ``output`` is an error.
    """
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens}: must be a positive number of tokens")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction}: must be in [0, 1), e.g. 0.01")
    output = Path(output).expanduser()
    _check_output(output, force, inputs)
    files = discover(inputs, fmt)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = dtype_for(tokenizer.vocab_size)

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        manifest = _tokenize_into(tmp, files, tokenizer, dtype, text_field, shard_tokens, val_fraction, max_tokens)
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
        raise ValueError(f"--output {output}: exists and is a file; choose a directory path")
    resolved = output.resolve()
    for raw in inputs:
        src = Path(raw).expanduser().resolve()
        if src == resolved or resolved in src.parents:
            raise ValueError(f"--output {output}: holds --input {raw}; write the dataset to a new folder, the "
                             "inputs are never replaced")
    if not output.is_dir() or not any(output.iterdir()):
        return
    ours = (output / MANIFEST_NAME).is_file()
    if ours and not force:
        raise ValueError(f"--output {output}: already a prepared dataset; pass --force to overwrite or choose another --output")
    if not ours:
        raise ValueError(f"--output {output}: exists and is not empty, and is not a folder made by `seektrain data "
                         "prepare` (no manifest.json), so --force will not replace it; choose a new directory")
    foreign = sorted(p.name for p in output.iterdir() if not _made_by_prepare(p))
    if foreign:
        raise ValueError(f"--output {output}: holds {foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
                         "which `seektrain data prepare` did not write, so --force will not replace the folder; move "
                         "it out or choose a new directory")


def _made_by_prepare(path: Path) -> bool:
    """manifest.json, shard-NNNNN.bin, val-NNNNN.bin, or a manifest temp file: nothing a user keeps."""
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


def _tokenize_into(
    directory: Path,
    files: list[tuple[Path, str]],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    text_field: str,
    shard_tokens: int,
    val_fraction: float,
    max_tokens: int | None,
) -> Manifest:
    writers = {"train": ShardWriter(directory, "shard", dtype, shard_tokens), "val": ShardWriter(directory, "val", dtype, shard_tokens)}
    counts = {"train": [0, 0], "val": [0, 0]}  # documents, tokens
    sources: list[dict[str, Any]] = []
    doc_index = 0
    done = False

    def flush(batch: list[str], source: dict[str, Any]) -> None:
        nonlocal doc_index, done
        flat: dict[str, list[int]] = {"train": [], "val": []}
        for ids in tokenizer.encode_batch(batch):
            split = "val" if is_val_document(doc_index, val_fraction) else "train"
            flat[split].extend(ids)
            flat[split].append(tokenizer.eos_id)
            counts[split][0] += 1
            counts[split][1] += len(ids) + 1
            source["documents"] += 1
            source["tokens"] += len(ids) + 1
            doc_index += 1
            if max_tokens is not None and counts["train"][1] + counts["val"][1] >= max_tokens:
                done = True
                break
        for split, ids in flat.items():
            if ids:
                writers[split].write(np.asarray(ids, dtype=np.int64))
        batch.clear()

    for path, kind in files:
        source: dict[str, Any] = {"path": str(path), "format": kind, "documents": 0, "tokens": 0}
        sources.append(source)
        batch: list[str] = []
        chars = 0
        for text in read_documents(path, kind, text_field):
            if not text:
                continue
            batch.append(text)
            chars += len(text)
            if chars >= _BATCH_CHARS:
                flush(batch, source)
                chars = 0
                if done:
                    break
        if batch and not done:
            flush(batch, source)
        if done:
            break

    if counts["train"][1] == 0:
        raise ValueError(f"inputs ({len(files)} files) contain no text; pass files with non-empty documents (check --text-field)")
    info = TokenizerInfo(tokenizer.spec, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id, tokenizer.fingerprint)
    return Manifest(
        tokenizer=info,
        dtype=dtype.name,
        train=Split(writers["train"].close(), counts["train"][1], counts["train"][0]),
        val=Split(writers["val"].close(), counts["val"][1], counts["val"][0]),
        val_fraction=val_fraction,
        sources=sources,
    )
