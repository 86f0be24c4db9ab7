"""File-level pieces of a checkpoint: checksums, directory fsync, the DCP writer with its test hook,
and one-line descriptions of failures.

Why separate from the manager: these have no distributed logic at all, and keeping them apart keeps
the commit protocol in manager.py readable on one screen.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def describe_error(err: BaseException) -> str:
    """One line for any save/load failure, including DCP's multi-rank CheckpointException."""
    if isinstance(err, CheckpointException):
        seen: dict[str, list[int]] = {}
        for rank, (exc, _trace) in sorted(err.failures.items()):
            seen.setdefault(describe_error(exc), []).append(rank)
        return "; ".join(f"rank {','.join(map(str, ranks))}: {msg}" for msg, ranks in seen.items())
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def is_disk_full(err: BaseException | None) -> bool:
    """``err`` (or what it wraps: DCP's per-rank failures, a cause) is a full disk: ENOSPC, or the
    "unexpected pos" of torch's zip writer, which is how a short write to a full disk shows there."""
    seen: set[int] = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        text = str(e)
        if "unexpected pos" in text or "No space left on device" in text:
            return True
        if isinstance(e, CheckpointException):
            stack += [exc for exc, _trace in e.failures.values()]
        stack += [e.__cause__, e.__context__]
    return False


class Writer(FileSystemWriter):
    """DCP's file writer for one checkpoint folder (the tests' fault injection, loaded through
    ``train/run_hooks.py``, derives the full-disk test hook from it)."""

    def __init__(self, path: Path):
        super().__init__(str(path))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
