"""Replace a small file all at once: write a temp file beside it, fsync, rename.

Why: a run folder's ``config.toml``, ``model_config.json``, ``env.json``, ``summary.json`` and a data
folder's ``manifest.json`` are read by resume, ``sample`` and ``convert``; a write that fails midway (disk
full, a kill) must leave the previous file, never half of a new one. No torch import, so data and config
code can use it.
"""

from __future__ import annotations

import os
import tempfile
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
