"""How fast checkpoints are, measured against the disk itself, and how long they stall training.

Why these numbers: a checkpoint can only be as fast as the disk, so DCP's save throughput is shown
next to the raw write bandwidth that ``dd`` gets on the same folder in the same run (direct I/O +
fsync where the file system allows it); and what training feels is not the write but the *stall*: the
time the training thread spends in ``CheckpointManager.save`` and, for an async save, in its commit
(``checkpoint_stall_s`` in a run's metrics). Async save shrinks it to the copy into host memory
(pinned on a GPU, into buffers reused from the first save on). Sync and async are printed side by
side, from the same model in the same run.

    python benchmarks/bench_checkpoint.py [--preset small-v3|dense-1.23b|PRESET] [--device cpu|cuda]
                                          [--dir /tmp/bench-ckpt] [--repeats 3]

One process, no process group (the manager then skips its collectives); the model is built on the
device with an initialised AdamW state, so the checkpoint is what training writes: fp32 weights + 2
moments. On a GPU machine it runs as is (``--device`` defaults to cuda when there is one);
``dense-1.23b`` is the 1.23B dense model measured on one H200 (tests/test_plan_model.py), 14.8 GB of state.
"""

from __future__ import annotations

import argparse
import os
import platform
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
from seektrain.platform import policy_for

# Benchmark shapes that are not presets: the 1.23B dense model measured on one H200 (tests/test_plan_model.py).
SHAPES = {
    "dense-1.23b": (
        "deepseek-llm-7b",
        dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            intermediate_size=5504,
        ),
    )
}


def model_config(name: str):
    if name in SHAPES:
        preset, changes = SHAPES[name]
        return get_preset(preset).replace(name=name, **changes)
    return get_preset(name)


def machine(device: torch.device) -> str:
    """The CPU's model name (lscpu), and the GPU's when the model is on one."""
    cpu = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        pass
    text = f"CPU {cpu} ({os.cpu_count()} cpus)"
    if device.type == "cuda":
        text += f", GPU {torch.cuda.get_device_name(device)}"
    return text + f", torch {torch.__version__}"


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def dd_write_mb_s(folder: Path, mib: int) -> tuple[float, str]:
    """Raw sequential write bandwidth of ``folder``'s disk (MB/s) and the dd flags that worked."""
    target = folder / "dd.bin"
    for flags in (["oflag=direct", "conv=fsync"], ["conv=fdatasync"]):
        t0 = time.perf_counter()
        proc = subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", *flags],
            capture_output=True,
            text=True,
        )
        elapsed = time.perf_counter() - t0
        target.unlink(missing_ok=True)
        if proc.returncode == 0:
            m = re.search(r"copied, ([\d.]+) s", proc.stderr)
            seconds = float(m.group(1)) if m else elapsed
            return mib * 1024**2 / seconds / 1e6, " ".join(flags)
    raise RuntimeError(f"dd failed on {folder}: {proc.stderr.strip()}")


def model_and_optimizer(name: str, device: torch.device):
    model = build_model(model_config(name), device=device, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # materialise exp_avg / exp_avg_sq like a training step does
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def timed_save(
    manager: CheckpointManager, step: int, model, optimizer, device: torch.device
) -> dict[str, float]:
    """One ``save`` as the trainer makes it: the call (training stalls), the background write (training
    would go on), and the commit on the training thread; seconds of each."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    manager.save(step, model, optimizer, {"step": step})
    t1 = time.perf_counter()
    while manager.in_flight():  # training steps would run here
        time.sleep(0.005)
    t2 = time.perf_counter()
    manager.wait()  # the commit (sync: nothing left)
    return {"save_s": t1 - t0, "background_s": t2 - t1, "commit_s": time.perf_counter() - t2}


def timed_saves(
    model, optimizer, root: Path, async_save: bool, repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Per save: the save call and the commit on the training thread (their sum is the stall), and the
    time until the checkpoint is committed. For an async save the "training loop" waits until the
    background write is done before committing, as the trainer's per-step check does."""
    out: dict[str, list[float]] = {"save": [], "commit": [], "stall": [], "total": []}
    manager = CheckpointManager(
        root, keep=1, async_save=async_save, rank=0, pin_memory=policy_for(device).pin_host_memory()
    )
    for step in range(1, repeats + 1):
        t = timed_save(manager, step, model, optimizer, device)
        out["save"].append(t["save_s"])
        out["commit"].append(t["commit_s"])
        out["stall"].append(t["save_s"] + t["commit_s"])
        out["total"].append(t["save_s"] + t["background_s"] + t["commit_s"])
    manager.close()
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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small-v3", help=f"a preset or {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp dir)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="saves of each kind (the first async one allocates the host buffers that later ones reuse)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        model, optimizer = model_and_optimizer(args.preset, device)
        total = count_params(model_config(args.preset)).total
        sync = timed_saves(model, optimizer, base / "sync", False, args.repeats, device)
        size = folder_bytes(base / "sync" / "checkpoints")
        asyn = timed_saves(model, optimizer, base / "async", True, args.repeats, device)
        raw = timed_dcp_writes(model, optimizer, base, args.repeats)
        dd_mb_s, dd_flags = dd_write_mb_s(base, max(256, min(4096, size // 1024**2)))
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    report(args, device, total, size, base, sync, asyn, raw, dd_mb_s, dd_flags)


def report(args, device, total, size, base, sync, asyn, raw, dd_mb_s, dd_flags) -> None:
    med = statistics.median
    later = slice(1, None) if args.repeats > 1 else slice(0, None)
    save_mb_s = size / med(sync["total"]) / 1e6
    raw_mb_s = size / med(raw) / 1e6
    print(
        f"checkpoint of {args.preset} on {device}: {total / 1e6:.0f}M parameters, model + AdamW state = "
        f"{size / 1e9:.2f} GB, {args.repeats} saves each; disk folder {base}; torch threads {args.threads}"
    )
    print(machine(device))
    print(f"{'':38}{'MB/s':>10}{'of dd':>8}")
    print(f"{'dd raw write (' + dd_flags + ')':38}{dd_mb_s:>10.0f}{'100%':>8}")
    print(f"{'dcp.save alone (write + fsync)':38}{raw_mb_s:>10.0f}{100 * raw_mb_s / dd_mb_s:>7.0f}%")
    print(f"{'our sync save (+ sha256, commit)':38}{save_mb_s:>10.0f}{100 * save_mb_s / dd_mb_s:>7.0f}%")
    print()
    rows = [
        ("training stalled (save() + commit)", "stall", later),
        ("  save() call, first save", "save", slice(0, 1)),
        ("  save() call, later saves", "save", later),
        ("  commit on the training thread", "commit", later),
        ("until committed (COMPLETE)", "total", later),
    ]
    print(f"{'median seconds' + (' of saves 2..' if args.repeats > 1 else ''):38}{'sync':>10}{'async':>10}")
    for label, key, which in rows:
        print(f"{label:38}{med(sync[key][which]):>9.3f}s{med(asyn[key][which]):>9.3f}s")


if __name__ == "__main__":
    main()
