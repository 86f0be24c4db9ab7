"""Replace a small file all at once: write a temp file beside it, fsync, rename.

Why: a run folder's ``config.toml``, ``model_config.json``, ``env.json``, ``summary.json`` and a data
folder's ``manifest.json`` are read by resume, ``sample`` and ``convert``; a write that fails midway (disk
full, a kill) must leave the previous file, never half of a new one. No torch import, so data and config
code can use it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_swapped(out: Path, write: Callable[[Path], object]) -> object:
    """Run ``write(tmp_folder)`` beside ``out`` and rename the result into place; the old folder (for an
    HF export, checked by ``models/hf_replace.check_target``) is removed only after the new one is
    complete, so a reader never sees half a folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        result = write(tmp)
        old = None
        if out.is_dir():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "model")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result
