"""Finding input files and reading documents out of them (plain text, JSON Lines, JSON, Parquet,
``datasets`` folders).

A plain-text file is one document; a JSONL line, a JSON array's element, a Parquet row or a row of a
Hugging Face ``save_to_disk`` folder is one document. Text and JSON files may be ``.gz`` or ``.zst``
compressed. Directories are walked recursively in sorted order so that the same inputs always give the
same token stream; a directory that ``save_to_disk`` wrote is read as one dataset instead.

``--format`` names how files are read (text, jsonl, json, parquet) or what their rows hold (chat:
``messages``, sharegpt, alpaca, completion: ``prompt``/``completion``; ``row_formats.py``). With
``auto`` a file's first row says which it holds (``row_kind``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from seektrain.data.arrow_folder import arrow_rows, data_files, looks_like_datasets_folder
from seektrain.data.json_rows import json_array_rows, jsonl_rows, plain_suffix, read_text
from seektrain.data.row_formats import ROW_KINDS, check_fits, detect
from seektrain.data.row_mapping import RowMapping
from seektrain.errors import UserError

FORMATS = ("auto", "text", "jsonl", "json", "parquet", *ROW_KINDS[1:])
ROW_FILES = ("jsonl", "json", "parquet", "arrow")  # the file kinds that hold rows

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .py .pyi .c .h .cc .cpp .hpp .cu .cuh .rs .go .java .js .ts .tsx "
    ".jsx .sh .toml .yaml .yml .ini .cfg .html .htm .css .xml .csv .tsv .sql .lua .rb .php .swift .kt "
    ".scala .hs .ml .jl .r .m .el .vim".split()
)
_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})


def _format_of(path: Path) -> str | None:
    suffix = plain_suffix(path)
    if suffix in (".jsonl", ".json", ".parquet"):
        return suffix[1:]
    if suffix in TEXT_SUFFIXES:
        return "text"
    return None


def discover(inputs: Sequence[str | Path], fmt: str = "auto") -> list[tuple[Path, str]]:
    """Resolve inputs into a sorted, de-duplicated list of (file, format).

    With ``fmt="auto"`` files inside directories are picked by extension and others are skipped; a file
    named explicitly with an unknown extension is an error rather than a silent skip. With an explicit
    format every non-hidden file found is read as that format.
    """
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: unknown format; use one of {', '.join(FORMATS)}")
    if not inputs:
        raise UserError("no --input given; pass one or more files or directories")
    rows_only = fmt in ROW_KINDS[1:]  # chat/completion rows live in files of rows
    if rows_only:
        fmt = "auto"
    found: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.exists():
            raise UserError(f"--input {raw}: no such file or directory; check the path")
        if path.is_file():
            kind = fmt if fmt != "auto" else _format_of(path)
            if rows_only and kind not in ROW_FILES:
                raise UserError(
                    f"--input {raw}: chat and completion rows are read from .jsonl, .json or .parquet "
                    "files; rename the file or pass --format jsonl"
                )
            if kind is None:
                raise UserError(
                    f"--input {raw}: unknown format (extension {path.suffix or 'none'!r}); pass "
                    "--format text|jsonl|json|parquet"
                )
            candidates = [(path, kind)]
        elif looks_like_datasets_folder(path):
            data_files(path)  # checks the folder now, before anything is tokenized
            candidates = [(path, "arrow")]
        else:
            candidates = []
            for f in _walk(path):
                kind = "arrow" if f.is_dir() else fmt if fmt != "auto" else _format_of(f)
                if kind is not None and not (rows_only and kind == "text"):
                    candidates.append((f, kind))
            if not candidates:
                raise UserError(
                    f"--input {raw}: no readable files found (format {fmt}); pass files with known "
                    "extensions or --format text"
                )
        for f, kind in candidates:
            resolved = f.resolve()
            if resolved not in seen:
                seen.add(resolved)
                found.append((resolved, kind))
    return found


def _walk(root: Path) -> Iterator[Path]:
    """The files under ``root``, and as one entry each the ``datasets`` folders among its subfolders."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for d in [d for d in dirnames if looks_like_datasets_folder(Path(dirpath) / d)]:
            data_files(Path(dirpath) / d)
            dirnames.remove(d)
            yield Path(dirpath) / d
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def read_documents(
    path: Path, kind: str, text_field: str = "text", mapping: RowMapping | None = None
) -> Iterator[str]:
    """Yield the documents of one file of text rows; a malformed record raises UserError naming file and line."""
    if kind == "text":
        yield read_text(path)
    elif kind == "parquet":
        yield from _read_parquet(path, text_field)
    else:
        for where, record in read_records(path, kind):
            check_fits(where, "text", record, mapping or RowMapping(), text_field)
            text = record[text_field]
            if not isinstance(text, str):
                raise UserError(
                    f"{where}: field {text_field!r} is {type(text).__name__}, not a string; "
                    "pass the right --text-field"
                )
            yield text


def _open_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading Parquet needs pyarrow; pip install 'seektrain[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise UserError(
            f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); check the file"
        ) from None


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    pf = _open_parquet(path)
    import pyarrow as pa

    if text_field not in pf.schema_arrow.names:
        raise UserError(
            f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); pass --text-field"
        )
    kind = pf.schema_arrow.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(
            f"{path}: column {text_field!r} holds {kind}, not text; pass --text-field with a string column"
        )
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield str(text)


def row_kind(
    path: Path, kind: str, text_field: str, forced: str | None = None, mapping: RowMapping | None = None
) -> str:
    """What the rows of one file hold: ``forced`` (``--format chat|sharegpt|...``) if given, else the
    format of its first row (``row_formats.detect``); an empty file holds text."""
    if forced is not None or kind == "text":
        return forced or "text"
    for where, record in read_records(path, kind):
        return detect(where, record, mapping or RowMapping(), text_field)
    return "text"


def read_records(path: Path, kind: str) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of a file of rows; ``where`` is ``file:line`` or ``file: row N``."""
    if kind == "jsonl":
        yield from jsonl_rows(path)
    elif kind == "json":
        yield from json_array_rows(path)
    elif kind == "arrow":
        yield from arrow_rows(path)
    elif kind == "parquet":
        pf = _open_parquet(path)
        row = 0
        for batch in pf.iter_batches(batch_size=256):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", record
    else:
        raise UserError(
            f"{path}: {kind} files hold no rows; chat and completion rows are read from .jsonl, .json, "
            ".parquet or a datasets folder"
        )
