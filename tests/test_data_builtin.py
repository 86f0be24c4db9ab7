"""The built-in corpus (this Python's stdlib sources): prepared once, reused, safe under concurrency."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from seektrain.data import TokenDataset, ensure_builtin_corpus, load_tokenizer, read_manifest
from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.builtin import builtin_corpus_dir, builtin_files, stdlib_dir


def test_builtin_files_are_sorted_stdlib_sources() -> None:
    files = builtin_files()
    root = stdlib_dir()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and "os.py" in rel
    assert not any(part in ("site-packages", "test", "tests") for r in rel for part in r.split("/"))


def test_prepares_once_and_loads(tmp_path: Path) -> None:
    path = ensure_builtin_corpus(tmp_path)
    assert path.parent == tmp_path and path.name.startswith("builtin-")
    m = read_manifest(path)
    assert m.tokenizer.spec == "byte" and m.train.tokens > 1_000_000 and m.val.documents > 0
    mtime = (path / "manifest.json").stat().st_mtime_ns
    assert ensure_builtin_corpus(tmp_path) == path and (path / "manifest.json").stat().st_mtime_ns == mtime
    loader = DistributedBatchLoader(TokenDataset(path), 64, 2, 0, 2, seed=0)
    batch = next(loader)
    tokens = batch.tokens
    assert tokens.shape == (2, 64) and int(tokens.max()) < 259
    text = load_tokenizer("byte").decode(tokens[0].tolist())
    assert text.isprintable() or "\n" in text
    val = DistributedBatchLoader(TokenDataset(path, "val"), 64, 2)
    assert len(list(itertools.islice(val, val.steps_per_epoch))) == val.steps_per_epoch


def test_cache_root_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEEKTRAIN_CACHE", str(tmp_path / "cache"))
    assert builtin_corpus_dir().parent == tmp_path / "cache"
    assert (
        builtin_corpus_dir(max_tokens=10) != builtin_corpus_dir()
    )  # the key covers what changes the content


def test_concurrent_callers_share_one_preparation(tmp_path: Path) -> None:
    code = (
        "import sys; from seektrain.data import ensure_builtin_corpus; "
        "print(ensure_builtin_corpus(sys.argv[1], max_tokens=300_000))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(outs)) == 1
    m = read_manifest(outs[0])
    assert 300_000 <= m.total_tokens < 400_000
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [Path(outs[0]).name]
