"""What reading a step's numbers on the host costs: the same run with ``run.log_interval=1`` (every
step is a flush step: its loss, gradient norm, loss scale and imbalance are read at once, which on a GPU
waits for the device) and ``run.log_interval=10`` (nine steps in ten read nothing), side by side.

    python benchmarks/bench_step_syncs.py [--preset tiny-v3] [--steps 40] [--repeats 2] [--set k=v ...]

Each configuration runs ``seektrain train`` as one process, alternating (A B A B ...) so drift in the
machine's load hits both alike. The figure is the wall time from one step's end to the next (the
``time`` of consecutive metrics.jsonl records: it includes the flush, which ``step_time_s`` does not),
median and mean over the steps after ``--warmup``; ``step_time_s`` (the step itself) is shown beside it.
On a CPU a read waits for nothing, so the two should differ by little; on a GPU the difference is the
device idle time each read causes (the host stops queueing work until the device drains).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        return "unknown CPU"


def run(run_dir: Path, log_interval: int, args) -> dict:
    overrides = [
        f"run.dir={run_dir}",
        f"run.log_interval={log_interval}",
        f"model.preset={args.preset}",
        f"train.steps={args.steps}",
        f"train.seq_len={args.seq}",
        f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={args.batch}",
        "checkpoint.interval=0",
        "train.eval_interval=0",
        "run.progress_bar=false",
        "metrics.tensorboard=false",
        "checkpoint.resume=never",
        *args.set,
    ]
    cmd = [sys.executable, "-m", "seektrain.cli.main", "train"] + [a for o in overrides for a in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = records[args.warmup :]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(steady)]
    return {"gaps": gaps, "step_time": [r["step_time_s"] for r in steady]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-v3")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides, k=v")
    args = parser.parse_args()
    results: dict[int, dict[str, list[float]]] = {
        1: {"gaps": [], "step_time": []},
        10: {"gaps": [], "step_time": []},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for interval in results:
                got = run(Path(tmp) / f"r{repeat}-i{interval}", interval, args)
                for key, values in got.items():
                    results[interval][key] += values
    print(
        f"{args.preset}, {args.batch} x {args.seq} tokens a step, {args.steps} steps x {args.repeats} runs each, "
        f"torch threads default, on {cpu_name()}"
    )
    print(
        f"{'run.log_interval':>16} | {'step-to-step median':>19} | {'mean':>8} | {'step_time_s median':>18}"
    )
    for interval, r in results.items():
        print(
            f"{interval:>16} | {statistics.median(r['gaps']) * 1e3:>16.1f} ms | "
            f"{statistics.mean(r['gaps']) * 1e3:>5.1f} ms | {statistics.median(r['step_time']) * 1e3:>15.1f} ms"
        )
    one, ten = (statistics.median(results[i]["gaps"]) for i in (1, 10))
    print(f"log_interval=10 vs 1: {100 * (one - ten) / one:+.1f}% step-to-step time saved (median)")


if __name__ == "__main__":
    main()
