"""Run the real `seektrain` CLI in a subprocess (as users do) and read what the run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Small, fast settings shared by the distributed training tests (fp32 so runs compare exactly).
TINY = [
    "train.seq_len=64",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "precision.dtype=fp32",
    "checkpoint.interval=0",
    "run.progress_bar=false",
    "metrics.tensorboard=false",
    "optim.warmup_steps=2",
]


def seektrain(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    env: dict | None = None,
    check: bool = True,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``input``: text piped to the command's stdin."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "seektrain.cli.main", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"seektrain {' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def train(run_dir: Path, *overrides: str, nproc: int = 1, extra_args: tuple[str, ...] = (), **kw):
    args = ["train", "--nproc-per-node", str(nproc), *extra_args, "--set", f"run.dir={run_dir}"]
    for item in (*TINY, *overrides):
        args += ["--set", item]
    return seektrain(*args, **kw)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate a server or run started by a test; kill it if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
