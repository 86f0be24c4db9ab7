"""The built-in corpus: this Python's own standard-library sources, prepared once into a cache.

Every machine that runs seektrain has them, so the default run trains on real text (code, docstrings,
comments) with no download. The prepared directory is keyed by a hash of the tokenizer, the Python
version and the stdlib location, and a file lock makes concurrent callers (e.g. all ranks of a
``torchrun`` at once) wait for a single preparer and then reuse its result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from seektrain.data.manifest import MANIFEST_NAME
from seektrain.data.manifest import VERSION as MANIFEST_VERSION
from seektrain.data.prepare import prepare_dataset
from seektrain.data.tokenizer import load_tokenizer
from seektrain.errors import UserError

CORPUS_VERSION = 1
DEFAULT_MAX_TOKENS = 1 << 25  # ~33M tokens: the whole stdlib with the byte tokenizer (~14M on 3.11)
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_dir() -> Path:
    return Path(os.__file__).resolve().parent


def builtin_files(root: Path | None = None) -> list[Path]:
    """All ``*.py`` under the stdlib, minus third-party packages and test suites, in sorted order."""
    root = root or stdlib_dir()
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    if not files:
        raise UserError(
            f"no Python source files under {root} (stdlib shipped as bytecode only?); set data.path "
            "to a prepared dataset instead"
        )
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def default_cache_root() -> Path:
    """``$SEEKTRAIN_CACHE`` if set, else ``~/.cache/seektrain``."""
    env = os.environ.get("SEEKTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "seektrain"


def builtin_corpus_dir(
    cache_dir: str | Path | None = None, tokenizer_spec: str = "byte", max_tokens: int = DEFAULT_MAX_TOKENS
) -> Path:
    """Where :func:`ensure_builtin_corpus` puts (or finds) the prepared corpus, without preparing it."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    key = {
        "corpus": CORPUS_VERSION,
        "manifest": MANIFEST_VERSION,  # a newer format (e.g. block checksums) prepares a new copy
        "tokenizer": load_tokenizer(tokenizer_spec).fingerprint,
        "python": sys.version,
        "stdlib": str(stdlib_dir()),
        "max_tokens": max_tokens,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"builtin-{digest}"


def ensure_builtin_corpus(
    cache_dir: str | Path | None = None, tokenizer_spec: str = "byte", max_tokens: int = DEFAULT_MAX_TOKENS
) -> Path:
    """Return the prepared built-in corpus under ``cache_dir`` (the cache root), preparing it if needed.

    Safe to call from many processes at once: exactly one prepares, the others block on the lock and
    then find the finished directory.
    """
    target = builtin_corpus_dir(cache_dir, tokenizer_spec, max_tokens)
    if (target / MANIFEST_NAME).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if not (target / MANIFEST_NAME).is_file():
            prepare_dataset(
                builtin_files(), target, tokenizer_spec, fmt="text", max_tokens=max_tokens, force=True
            )
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock``; where fcntl is missing the atomic rename in prepare_dataset still holds."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
