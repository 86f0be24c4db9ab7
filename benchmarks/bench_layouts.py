"""Training throughput of every parallel layout on 2 and 4 CPU ranks, through the real CLI.

    python benchmarks/bench_layouts.py [--preset tiny-v3] [--steps 6] [--warmup 2] [--only NAME ...]

Each layout is one ``seektrain train --nproc-per-node N --set parallel...`` run (torchrun, gloo,
``OMP_NUM_THREADS=1`` per worker) of the same model, sequence length and global batch; the figure is
the median ``tokens_per_s`` (global tokens per step / step time) over the steps after the warm-up,
read from ``run.dir/metrics.jsonl``. The baseline is one process with one thread (the same per-rank
thread count as the workers); one process with all cores' threads is shown too. The ratio is against
the one-thread baseline.

With 4 ranks on a machine with fewer cores than ranks, the workers oversubscribe the CPU: they time-share
cores, so 4-rank figures measure contention (and gloo over shared memory), not scaling. The script prints
the core count and the load average before and after every run; other jobs on the machine show up there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (name, ranks, --set overrides)
LAYOUTS = [
    ("single (1 thread)", 1, []),
    ("single (all cores)", 1, []),
    ("fsdp dp=2", 2, []),
    ("ddp dp=2", 2, ["parallel.data_parallel=ddp", "parallel.dp_shard=1", "parallel.dp_replicate=2"]),
    ("tp=2", 2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    ("pp=2 (1f1b)", 2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b"]),
    ("fsdp dp=2 x ep=2", 2, ["parallel.ep=2"]),
    ("tp=2 x ep=2", 2, ["parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=1"]),
    ("fsdp dp=4", 4, []),
    ("ddp dp=4", 4, ["parallel.data_parallel=ddp", "parallel.dp_shard=1", "parallel.dp_replicate=4"]),
    ("tp=2 x dp=2 (fsdp)", 4, ["parallel.tp=2", "parallel.dp_shard=2"]),
    ("tp=2 x dp=2 x ep=4", 4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=4"]),
    (
        "tp=2 x ddp=2",
        4,
        ["parallel.tp=2", "parallel.dp_shard=1", "parallel.dp_replicate=2", "parallel.data_parallel=ddp"],
    ),
    ("tp=2 x pp=2", 4, ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1"]),
    ("pp=2 x dp=2 (fsdp)", 4, ["parallel.pp=2", "parallel.dp_shard=2"]),
    ("fsdp dp=4 x ep=2", 4, ["parallel.ep=2"]),
]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-v3")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped before the median")
    ap.add_argument("--only", nargs="*", default=None, help="layout names to run (default: all)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", default="", help="keep the run folders under this directory")
    return ap.parse_args()


def run_layout(name: str, nproc: int, overrides: list[str], args, root: Path) -> dict:
    run_dir = root / name.replace(" ", "_").replace("=", "").replace("(", "").replace(")", "")
    threads = os.cpu_count() if name == "single (all cores)" else 1
    settings = [
        f"run.dir={run_dir}",
        f"model.preset={args.preset}",
        f"precision.dtype={args.dtype}",
        f"train.seq_len={args.seq}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.steps={args.steps}",
        "checkpoint.interval=0",
        "run.progress_bar=false",
        "metrics.tensorboard=false",
        "optim.warmup_steps=2",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "seektrain.cli.main", "train", "--nproc-per-node", str(nproc)]
    for s in settings:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
    wall = time.perf_counter() - t0
    result = {
        "name": name,
        "nproc": nproc,
        "threads_per_rank": threads,
        "overrides": overrides,
        "command": f"seektrain train --nproc-per-node {nproc} {' '.join(f'--set {s}' for s in settings)}",
        "rc": rc,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        lines = [ln for ln in (err or out).strip().splitlines() if ln.strip()]
        result["error"] = "\n".join(lines[-15:])
        return result
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = [r for r in records if r["step"] > args.warmup] or records
    result["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
    result["tokens_per_s_all"] = [round(r["tokens_per_s"], 1) for r in steady]
    result["step_time_s"] = statistics.median(r["step_time_s"] for r in steady)
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        result["layout"] = s.get("layout")
        result["param_elements_rank0"] = s.get("param_elements_rank0")
    result["final_loss"] = records[-1].get("loss")
    return result


def main() -> None:
    args = parse()
    layouts = [lay for lay in LAYOUTS if args.only is None or lay[0] in args.only]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-layouts-"))
    root.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count()
    print(
        f"model {args.preset}, {args.dtype}, seq {args.seq}, global batch {args.global_batch} sequences "
        f"({args.global_batch * args.seq} tokens/step), micro-batch {args.micro_batch}; {args.steps} steps, "
        f"median tokens/s over steps > {args.warmup}; gloo on CPU, OMP_NUM_THREADS=1 per rank; {cores} CPU cores"
    )
    if any(n > cores for _, n, _ in layouts):
        print(
            f"NOTE: {max(n for _, n, _ in layouts)} ranks on {cores} cores oversubscribe the CPU: ranks time-share "
            "cores, so those rows measure contention, not scaling."
        )
    results = []
    for name, nproc, overrides in layouts:
        r = run_layout(name, nproc, overrides, args, root)
        results.append(r)
        status = f"{r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else f"FAILED rc={r['rc']}"
        print(
            f"  {name:<22} {status}  ({r['wall_s']:.0f} s, load {r['load_before']:.1f} -> {r['load_after']:.1f})",
            flush=True,
        )
    base = next((r.get("tokens_per_s") for r in results if r["name"] == "single (1 thread)"), None)
    print()
    head = (
        f"| {'layout':<22} | {'ranks':>5} | {'thr/rank':>8} | {'tokens/s':>9} | {'vs 1 proc':>9} | "
        f"{'step s':>6} | {'params rank0':>12} | {'load':>9} |"
    )
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for r in results:
        if "tokens_per_s" not in r:
            print(
                f"| {r['name']:<22} | {r['nproc']:>5} | {r['threads_per_rank']:>8} | {'FAILED':>9} | {'-':>9} | "
                f"{'-':>6} | {'-':>12} | {r['load_before']:4.1f}/{r['load_after']:<4.1f} |"
            )
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        over = " *" if r["nproc"] > cores else ""
        print(
            f"| {r['name'] + over:<22} | {r['nproc']:>5} | {r['threads_per_rank']:>8} | {r['tokens_per_s']:>9.0f} | "
            f"{ratio:>9} | {r['step_time_s']:>6.3f} | {r.get('param_elements_rank0') or 0:>12,} | "
            f"{r['load_before']:4.1f}/{r['load_after']:<4.1f} |"
        )
    if any(r["nproc"] > cores for r in results):
        print(f"* {cores} cores for more ranks: oversubscribed.")
    print("load: 1-minute load average before/after the run (includes other jobs on the machine).")
    for r in results:
        if "error" in r:
            print(
                f"\nFAILED: {r['name']}\n  command: {r['command']}\n  exit: {r['rc']}\n  "
                + r["error"].replace("\n", "\n  ")
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "cores": cores, "results": results}, indent=1)
        )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
