"""How fast checkpoints are, measured against the disk itself.

Why these two numbers: a checkpoint can only be as fast as the disk, so DCP's save throughput is shown
next to the raw write bandwidth that ``dd`` gets on the same folder in the same run (direct I/O +
fsync where the file system allows it); and what training feels is not the write but the *stall*, the
wall time of ``CheckpointManager.save`` on the training thread, which async save shrinks to the
copy into host memory. Both are printed side by side.

    python benchmarks/bench_checkpoint.py [--preset small-v3] [--dir /tmp/bench-ckpt] [--repeats 2]

One process, no process group (the manager then skips its collectives); the model is built with an
initialised AdamW state, so the checkpoint is what training writes: fp32 weights + 2 moments.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from seektrain.checkpoint.manager import CheckpointManager
from seektrain.models import build_model, count_params, get_preset


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def dd_write_mb_s(folder: Path, mib: int) -> tuple[float, str]:
    """Raw sequential write bandwidth of ``folder``'s disk (MB/s) and the dd flags that worked."""
    target = folder / "dd.bin"
    for flags in (["oflag=direct", "conv=fsync"], ["conv=fdatasync"]):
        t0 = time.perf_counter()
        proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", *flags],
                              capture_output=True, text=True)
        elapsed = time.perf_counter() - t0
        target.unlink(missing_ok=True)
        if proc.returncode == 0:
            m = re.search(r"copied, ([\d.]+) s", proc.stderr)
            seconds = float(m.group(1)) if m else elapsed
            return mib * 1024**2 / seconds / 1e6, " ".join(flags)
    raise RuntimeError(f"dd failed on {folder}: {proc.stderr.strip()}")


def model_and_optimizer(preset: str):
    model = build_model(get_preset(preset), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # materialise exp_avg / exp_avg_sq like a training step does
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def timed_saves(model, optimizer, root: Path, async_save: bool, repeats: int) -> dict[str, list[float]]:
    """Per save: the stall (the save call on the training thread) and the time until it is committed."""
    out: dict[str, list[float]] = {"stall": [], "total": []}
    manager = CheckpointManager(root, keep=1, async_save=async_save, rank=0)
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        manager.save(step, model, optimizer, {"step": step})
        t1 = time.perf_counter()
        manager.wait()  # async: a training loop would run steps here
        out["stall"].append(t1 - t0)
        out["total"].append(time.perf_counter() - t0)
    return out


def timed_dcp_writes(model, optimizer, root: Path, repeats: int) -> list[float]:
    """Plain ``dcp.save`` of the same state (no checksums, no commit): DCP's own write speed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    times = []
    for i in range(repeats):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        t0 = time.perf_counter()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / f"w{i}"))
        times.append(time.perf_counter() - t0)
        shutil.rmtree(root / f"w{i}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-v3")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        model, optimizer = model_and_optimizer(args.preset)
        total = count_params(get_preset(args.preset)).total
        sync = timed_saves(model, optimizer, base / "sync", False, args.repeats)
        size = folder_bytes(base / "sync" / "checkpoints")
        asyn = timed_saves(model, optimizer, base / "async", True, args.repeats)
        raw = timed_dcp_writes(model, optimizer, base, args.repeats)
        dd_mb_s, dd_flags = dd_write_mb_s(base, max(256, min(4096, size // 1024**2)))
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    save_mb_s = size / med(sync["stall"]) / 1e6
    raw_mb_s = size / med(raw) / 1e6
    print(f"checkpoint of {args.preset}: {total / 1e6:.0f}M parameters, model + AdamW state = "
          f"{size / 1e9:.2f} GB, {args.repeats} saves each, median; disk folder {base}; "
          f"torch threads {args.threads}, cpus {os.cpu_count()}")
    print(f"{'':34}{'MB/s':>10}{'of dd':>8}")
    print(f"{'dd raw write (' + dd_flags + ')':34}{dd_mb_s:>10.0f}{'100%':>8}")
    print(f"{'dcp.save alone (write + fsync)':34}{raw_mb_s:>10.0f}{100 * raw_mb_s / dd_mb_s:>7.0f}%")
    print(f"{'our sync save (+ sha256, commit)':34}{save_mb_s:>10.0f}{100 * save_mb_s / dd_mb_s:>7.0f}%")
    print()
    print(f"{'training stalled by one save':34}{'sync':>10}{'async':>10}")
    print(f"{'  save() call on training thread':34}{med(sync['stall']):>9.2f}s{med(asyn['stall']):>9.2f}s")
    print(f"{'  until committed (COMPLETE)':34}{med(sync['total']):>9.2f}s{med(asyn['total']):>9.2f}s")


if __name__ == "__main__":
    main()
