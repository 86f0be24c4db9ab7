"""Finding input files and reading documents out of them (plain text, JSON Lines, Parquet).

A plain-text file is one document; a JSONL line or a Parquet row is one document. Directories are
walked recursively in sorted order so that the same inputs always give the same token stream.

``--format`` names how files are read (text, jsonl, parquet) or, for JSONL and Parquet files picked by
extension, what their rows hold (chat: ``messages``; completion: ``prompt``/``completion``). With
``auto`` a JSONL/Parquet file's first row says which it holds (``row_kind``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from seektrain.errors import UserError

FORMATS = ("auto", "text", "jsonl", "parquet", "chat", "completion")
ROW_KINDS = ("text", "chat", "completion")

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .py .pyi .c .h .cc .cpp .hpp .cu .cuh .rs .go .java .js .ts .tsx "
    ".jsx .sh .toml .yaml .yml .ini .cfg .html .htm .css .xml .csv .tsv .sql .lua .rb .php .swift .kt "
    ".scala .hs .ml .jl .r .m .el .vim".split()
)
_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})


def _format_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
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
    rows_only = fmt in ROW_KINDS[1:]  # chat/completion rows live in JSONL or Parquet files
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
            if rows_only and kind not in ("jsonl", "parquet"):
                raise UserError(
                    f"--input {raw}: chat and completion rows are read from .jsonl or .parquet files; "
                    "rename the file or pass --format jsonl"
                )
            if kind is None:
                raise UserError(
                    f"--input {raw}: unknown format (extension {path.suffix or 'none'!r}); pass "
                    "--format text|jsonl|parquet"
                )
            candidates = [(path, kind)]
        else:
            candidates = []
            for f in _walk(path):
                kind = fmt if fmt != "auto" else _format_of(f)
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
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def read_documents(path: Path, kind: str, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of one file; a malformed record raises ValueError naming file and line."""
    if kind == "text":
        yield path.read_text(encoding="utf-8", errors="replace")
    elif kind == "jsonl":
        yield from _read_jsonl(path, text_field)
    elif kind == "parquet":
        yield from _read_parquet(path, text_field)
    else:
        raise UserError(f"{path}: unknown format {kind!r}; use one of text, jsonl, parquet")


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); fix the line or remove it"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                raise UserError(
                    f"{path}:{lineno}: no field {text_field!r}; pass --text-field with the name of the text field"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise UserError(
                    f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string; "
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


def row_kind(path: Path, kind: str, text_field: str, forced: str | None = None) -> str:
    """What the rows of one file hold: ``forced`` (``--format chat|completion``) if given, else what its
    first row has: ``messages`` (chat), ``prompt`` and ``completion`` (completion), or text."""
    if forced is not None or kind == "text":
        return forced or "text"
    for _, record in read_records(path, kind):
        if isinstance(record, dict) and "messages" in record:
            return "chat"
        if (
            isinstance(record, dict)
            and "prompt" in record
            and "completion" in record
            and text_field not in record
        ):
            return "completion"
        break
    return "text"


def read_records(path: Path, kind: str) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of a JSONL or Parquet file; ``where`` is ``file:line`` or ``file: row N``."""
    if kind == "jsonl":
        with path.open(encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{path}:{lineno}: invalid JSON ({e.msg}); fix the line or remove it"
                    ) from None
    elif kind == "parquet":
        pf = _open_parquet(path)
        row = 0
        for batch in pf.iter_batches(batch_size=256):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", record
    else:
        raise UserError(
            f"{path}: {kind} files hold no rows; chat and completion rows are read from .jsonl or .parquet"
        )
