"""Rows of JSON Lines and JSON-array files, plain or compressed (``.gz``, ``.zst``), each with its ``FILE:LINE``.

Datasets ship as one JSON array as often as one object per line, and are often kept compressed; both
are read as they are, so nobody unpacks or rewrites a file to prepare it. A JSON array is parsed
element by element so that an error still names the line the bad row starts on.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from seektrain.errors import UserError

COMPRESSED = (".gz", ".zst")


def plain_suffix(path: Path) -> str:
    """The extension that says the format: ``.jsonl`` for both ``a.jsonl`` and ``a.jsonl.gz``."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def open_text(path: Path) -> IO[str]:
    """``path`` opened as UTF-8 text (invalid bytes replaced), decompressed when it ends in .gz or .zst."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if suffix == ".zst":
        try:
            import zstandard  # type: ignore[import-not-found]  # optional: only for .zst inputs
        except ImportError:
            raise UserError(
                f"{path}: reading .zst files needs the zstandard module; pip install zstandard"
            ) from None
        raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


def read_text(path: Path) -> str:
    with _reading(path), open_text(path) as f:
        return f.read()


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with _reading(path), open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); fix the line or remove it"
                ) from None


def json_array_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """The elements of a file holding one JSON array, each named by the line it starts on."""
    text = read_text(path)
    decoder = json.JSONDecoder()
    pos, line = _skip(text, 0), 1
    if not text.startswith("[", pos):
        raise UserError(
            f"{path}: a .json file must hold one array of rows; for one object per line name it .jsonl"
        )
    pos, at = _skip(text, pos + 1), 0
    while True:
        line += text.count("\n", at, pos)
        at = pos
        if text.startswith("]", pos):
            return
        try:
            row, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); fix the row or remove it") from None
        yield f"{path}:{line}", row
        pos = _skip(text, end)
        if text.startswith(",", pos):
            pos = _skip(text, pos + 1)
        elif not text.startswith("]", pos):
            where = line + text.count("\n", at, pos)
            raise UserError(f"{path}:{where}: invalid JSON (expected ',' or ']' after a row); fix the file")


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A damaged compressed stream surfaces as one line naming the file, not as a traceback."""
    try:
        yield
    except (OSError, EOFError, zlib.error) as err:
        raise UserError(f"{path}: unreadable ({err}); check the file") from None
