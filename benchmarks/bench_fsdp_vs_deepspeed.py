"""Training throughput and memory: ``seektrain train`` (FSDP2) against DeepSpeed ZeRO-3, same model.

Both sides train our ``Transformer`` (preset ``small-v3`` by default, MTP on in both, same seeded init)
on 2 CPU ranks over gloo, bf16 compute with fp32 master weights, AdamW with the same hyper-parameters,
parameter groups and schedule, gradient clipping at 1.0, the same global/micro batch and sequence
length, and the same number of threads per rank (``OMP_NUM_THREADS`` for both launches, plus
``torch.set_num_threads`` in the DeepSpeed worker). Ours is the real CLI:

    seektrain train --nproc-per-node 2 --set model.preset=... --set precision.dtype=bf16 ...

whose ``metrics.jsonl`` gives the per-step time; DeepSpeed runs ``benchmarks/ds_zero3_worker.py`` under
torchrun. Tokens/s is the median over the steps after ``--warmup``; the runs alternate (ours, DeepSpeed,
ours, ...) ``--repeats`` times so that load from other processes hits both alike, and the median over
repeats is reported. A third side, the ceiling, runs ``--nproc`` independent one-process trainings at
once, each with one rank's share of the batch: no communication at all, so no data-parallel engine can
beat its summed tokens/s on this machine, and the largest possible lead over DeepSpeed is printed
(``--no-ceiling`` skips it). Peak RSS: every worker process is sampled from outside (psutil, every 0.1 s) over
its whole life; in addition each side reports its own peak from inside (ours: rank 0's
``mem_peak_rss_gib`` at the last step, before the final checkpoint; DeepSpeed: ``ru_maxrss`` per rank).

    python benchmarks/bench_fsdp_vs_deepspeed.py                  # small-v3, batch 4 x seq 512, 1 thread/rank
    python benchmarks/bench_fsdp_vs_deepspeed.py --preset tiny-v3 --seq 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = float(1 << 30)


class RssSampler:
    """Peak RSS of ``pid`` and every descendant process (the workers), sampled every ``interval`` s."""

    def __init__(self, pid: int, interval: float = 0.1):
        import psutil

        self._psutil, self._root, self.interval = psutil, psutil.Process(pid), interval
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                children = [self._root, *self._root.children(recursive=True)]  # a 1-process run has none
            except self._psutil.Error:
                break
            for child in children:
                try:
                    if "python" not in child.name().lower():
                        continue
                    rss = child.memory_info().rss
                except self._psutil.Error:
                    continue
                self.peaks[child.pid] = max(self.peaks.get(child.pid, 0), rss)
            self._stop.wait(self.interval)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        # the launcher's own helpers are small; the workers are the two largest processes
        return sorted((v / GIB for v in self.peaks.values()), reverse=True)


def _run(cmd: list[str], env: dict, log: Path, nproc: int) -> tuple[int, list[float], float]:
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=HERE.parent)
        sampler = RssSampler(proc.pid)
        rc = proc.wait()
    peaks = sampler.stop()[:nproc]
    return rc, peaks, time.perf_counter() - t0


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _train_cmd(args, run_dir: Path, nproc: int, global_batch: int) -> list[str]:
    sets = {
        "model.preset": args.preset,
        "train.steps": args.steps,
        "train.global_batch_size": global_batch,
        "train.micro_batch_size": args.micro_batch,
        "train.seq_len": args.seq,
        "precision.dtype": "bf16",
        "run.dir": run_dir,
        "checkpoint.interval": 0,
        "metrics.tensorboard": "false",
        "run.progress_bar": "false",
        "run.log_interval": 1,
        "precision.reduce_dtype": args.reduce_dtype,
    }
    cmd = [sys.executable, "-m", "seektrain.cli.main", "train", "--nproc-per-node", str(nproc)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def _metrics(run_dir: Path, warmup: int) -> tuple[list[dict], list[dict]]:
    """(every step's record, the records after the warm-up steps)."""
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    return records, [r for r in records if r["step"] > warmup] or records


def run_ceiling(args, work: Path, rep: int) -> dict:
    """``--nproc`` independent one-process runs at once, each with one rank's share of the batch.

    Nothing is communicated and each holds the whole model and optimizer, so their summed tokens/s is
    what any data-parallel engine could reach on this machine with this per-rank work: the ceiling for
    both engines (up to the optimizer step, which here runs over all parameters, not a shard).
    """
    env, procs, logs = _env(args.threads), [], []
    t0 = time.perf_counter()
    for i in range(args.nproc):
        logs.append(open(work / f"ceiling{rep}-{i}.log", "w"))
        cmd = _train_cmd(args, work / f"ceiling{rep}-{i}", 1, args.global_batch // args.nproc)
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, cwd=HERE.parent)
        )
    samplers = [RssSampler(p.pid) for p in procs]
    rcs = [p.wait() for p in procs]
    for fh in logs:
        fh.close()
    peaks = sorted((max(sm.stop() or [0.0]) for sm in samplers), reverse=True)
    if any(rcs):
        sys.exit(f"one-process run failed (rc {rcs}); see {work}/ceiling{rep}-*.log")
    runs = [_metrics(work / f"ceiling{rep}-{i}", args.warmup) for i in range(args.nproc)]
    return {
        "tokens_per_s": sum(statistics.median(r["tokens_per_s"] for r in timed) for _, timed in runs),
        "step_s": max(statistics.median(r["step_time_s"] for r in timed) for _, timed in runs),
        "loss_last": runs[0][0][-1]["loss"],
        "sampled_peak_rss_gib": peaks,
        "wall_s": time.perf_counter() - t0,
    }


def run_ours(args, work: Path, rep: int) -> dict:
    run_dir = work / f"ours{rep}"
    cmd = _train_cmd(args, run_dir, args.nproc, args.global_batch)
    rc, peaks, wall = _run(cmd, _env(args.threads), work / f"ours{rep}.log", args.nproc)
    if rc:
        sys.exit(f"seektrain train failed (rc {rc}); see {work / f'ours{rep}.log'}")
    records, timed = _metrics(run_dir, args.warmup)
    log = (run_dir / "train.log").read_text()
    local = re.search(r"(\d+) local parameter elements on rank 0", log)
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "loss_last": records[-1]["loss"],
        "inside_peak_rss_gib": [records[-1].get("mem_peak_rss_gib", float("nan"))],
        "sampled_peak_rss_gib": peaks,
        "wall_s": wall,
        "local_numel": int(local.group(1)) if local else None,
    }


# DeepSpeed variants: its defaults as a user runs it; the same plus the allocator setting seektrain's CPU
# workers use (so that difference can be told apart from the engines'); overlap_comm off.
DS_VARIANTS = {"default": [], "kept": ["--keep-freed-memory"], "no-overlap": ["--overlap-comm", "false"]}


def run_deepspeed(args, work: Path, rep: int, variant: str = "default") -> dict:
    out = work / f"ds-{variant}{rep}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(HERE / "ds_zero3_worker.py"),
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--global-batch",
        str(args.global_batch),
        "--micro-batch",
        str(args.micro_batch),
        "--seq",
        str(args.seq),
        "--threads",
        str(args.threads),
        "--reduce-dtype",
        args.reduce_dtype,
        "--out",
        str(out),
        *DS_VARIANTS[variant],
    ]
    log = work / f"ds-{variant}{rep}.log"
    rc, peaks, wall = _run(cmd, _env(args.threads), log, args.nproc)
    if rc:
        sys.exit(f"DeepSpeed worker failed (rc {rc}); see {log}")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.nproc)]
    r0 = ranks[0]
    return {
        "tokens_per_s": r0["tokens_per_s"],
        "step_s": r0["median_step_s"],
        "loss_last": r0["losses"][-1],
        "inside_peak_rss_gib": [r["peak_rss_gib"] for r in ranks],
        "sampled_peak_rss_gib": peaks,
        "wall_s": wall,
        "state": {k: r0[k] for k in ("param_bytes", "master_bytes", "optim_state_bytes")},
        "n_params": r0["n_params"],
        "threads": r0["threads"],
    }


def _fmt_list(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-v3")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (both sides)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument(
        "--reduce-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="dtype of the gradient reduction on both sides (ours: precision.reduce_dtype, the default "
        "fp32; DeepSpeed: communication_data_type, whose default under bf16 is bf16)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs of each side")
    ap.add_argument(
        "--ds-variants",
        default="default,kept",
        help=f"DeepSpeed runs to compare with, comma-separated, the first is the headline: "
        f"{', '.join(DS_VARIANTS)} (default: its defaults, and the same with freed memory kept "
        f"as seektrain's CPU workers do)",
    )
    ap.add_argument(
        "--no-ceiling",
        action="store_true",
        help="skip the no-communication ceiling (--nproc independent one-process runs at once)",
    )
    ap.add_argument("--keep", help="keep run folders and logs here (default: a temporary folder)")
    args = ap.parse_args(argv)

    import deepspeed
    import torch

    print(
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}; {args.nproc} ranks (gloo, CPU), "
        f"{args.threads} thread(s) per rank, cpu cores {os.cpu_count()}, load avg {os.getloadavg()}"
    )
    print(
        f"model {args.preset} (MTP on in both), bf16 compute, {args.reduce_dtype} gradient reduction, "
        f"global batch {args.global_batch} (micro {args.micro_batch}) "
        f"x seq {args.seq} = {args.global_batch * args.seq} tokens/step, {args.steps} steps "
        f"(medians over steps > {args.warmup})"
    )
    ctx = tempfile.TemporaryDirectory() if not args.keep else None
    work = Path(args.keep or ctx.name)
    work.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.ds_variants.split(",") if v]
    unknown = [v for v in variants if v not in DS_VARIANTS]
    if unknown or not variants:
        sys.exit(f"--ds-variants: unknown {unknown or 'empty list'}; choose from {', '.join(DS_VARIANTS)}")
    sides = ["ours", *(f"deepspeed[{v}]" for v in variants)] + ([] if args.no_ceiling else ["ceiling"])
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(args.repeats):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            res = (
                run_ours(args, work, rep)
                if side == "ours"
                else run_ceiling(args, work, rep)
                if side == "ceiling"
                else run_deepspeed(args, work, rep, side[len("deepspeed[") : -1])
            )
            results[side].append(res)
            print(
                f"  run {rep + 1} {side:22s}: {res['tokens_per_s']:8.0f} tokens/s, median step {res['step_s']:.2f}s, "
                f"last loss {res['loss_last']:.3f}, sampled peak RSS {_fmt_list(res['sampled_peak_rss_gib'])} GiB, "
                f"wall {res['wall_s']:.0f}s",
                flush=True,
            )
    print(f"  load avg at end: {os.getloadavg()}")

    ours, ds = results["ours"], results[sides[1]]
    tps_ours = statistics.median(r["tokens_per_s"] for r in ours)
    tps_ds = statistics.median(r["tokens_per_s"] for r in ds)
    n = ds[-1]["n_params"]
    state = ds[-1]["state"]
    ds_state = (
        state["param_bytes"] + state["master_bytes"] + state["master_bytes"] + state["optim_state_bytes"]
    )
    local = ours[-1]["local_numel"]
    ours_state = local * (4 + 4 + 8) if local else float("nan")

    def peak(rs, key):
        return [max(r[key][i] for r in rs) for i in range(len(rs[0][key]))]

    print()
    print(f"{'':44s} {'seektrain FSDP2':>18s} {'DS ZeRO-3 ' + variants[0]:>18s} {'ratio':>7s}")
    print(f"{'training tokens/s (median)':44s} {tps_ours:18.0f} {tps_ds:18.0f} {tps_ours / tps_ds:6.2f}x")
    s_ours, s_ds = peak(ours, "sampled_peak_rss_gib"), peak(ds, "sampled_peak_rss_gib")
    print(
        f"{'peak RSS per rank, sampled (GiB)':44s} {_fmt_list(s_ours):>18s} {_fmt_list(s_ds):>18s} "
        f"{max(s_ds) / max(s_ours):6.2f}x"
    )
    i_ours, i_ds = peak(ours, "inside_peak_rss_gib"), peak(ds, "inside_peak_rss_gib")
    print(
        f"{'peak RSS reported inside (GiB; ours rank 0)':44s} {_fmt_list(i_ours):>18s} {_fmt_list(i_ds):>18s}"
    )
    print(
        f"{'param+grad+optimizer state per rank (MiB)':44s} {ours_state / 2**20:18.1f} {ds_state / 2**20:18.1f} "
        f"{ds_state / ours_state:6.2f}x"
    )
    print(
        f"  ({n / 1e6:.1f}M parameters. Ours: {local:,} local fp32 elements x (4 param + 4 grad + 8 Adam) B. "
        f"DeepSpeed, measured on its optimizer: bf16 partitions {state['param_bytes'] / 2**20:.1f} + fp32 master "
        f"{state['master_bytes'] / 2**20:.1f} + fp32 grad partition (same size as master) + Adam moments "
        f"{state['optim_state_bytes'] / 2**20:.1f} MiB.)"
    )
    for side in (s for s in sides[1:] if s != "ceiling"):
        tps = statistics.median(r["tokens_per_s"] for r in results[side])
        peak_side = max(peak(results[side], "sampled_peak_rss_gib"))
        print(
            f"ratio: ours / {side} tokens/s = {tps_ours / tps:.2f}x ({tps_ours:.0f} vs {tps:.0f}; "
            f"sampled peak RSS {max(s_ours):.2f} vs {peak_side:.2f} GiB) (target >= 1.5x)"
        )
    if "ceiling" in results:
        tps_ceiling = statistics.median(r["tokens_per_s"] for r in results["ceiling"])
        print(
            f"ceiling: {args.nproc} independent one-process runs at once (no communication, whole optimizer "
            f"each) {tps_ceiling:.0f} tokens/s; ours reaches {tps_ours / tps_ceiling:.0%} of it, "
            f"{sides[1]} {tps_ds / tps_ceiling:.0%}; the most any engine could lead {sides[1]} by here is "
            f"{tps_ceiling / tps_ds:.2f}x"
        )
    if ctx:
        ctx.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
