"""Soak test of resuming (not in CI): a 2-process run whose workers are killed at random moments, over
and over, must end exactly where an uninterrupted run of the same config ends.

Why: the CI tests kill one worker at one chosen step. A real cluster kills workers wherever they happen
to be: inside an async checkpoint's write, its commit, an evaluation, the start-up or the resume itself,
and many times in one run. Each of these must leave a run folder that the next attempt resumes from
exactly, so this script does just that, hundreds of steps long, and then checks everything the run
produced against an uninterrupted run started next to it:

* the whole loss trajectory: every metric of every step that is not a timing or a memory figure
  (loss, lm/MTP loss, lr, grad norm, loss scale, skips, expert balance, validation loss), the last
  record of each step against the uninterrupted run's, and every recomputation of a step (the steps
  after the last checkpoint are trained again after a restart) against its first computation;
* the final checkpoint: its checksums, and every tensor (weights, balancing biases, AdamW moments and
  steps) bit for bit, and the trainer state (step, schedule, scaler, data position, loss history);
* nothing left behind: no ``step-N.tmp`` and no ``.corrupt`` checkpoint.

How it kills: both runs go through the real CLI, ``seektrain train --nproc-per-node 2 --max-restarts K``
(torchrun restarts both workers after one dies; they resume from the last committed checkpoint). After
each start the script draws how many steps the attempt may log (uniform 1 .. 2 x ``--kill-every``) and
a moment inside the next step, or, with probability ``--startup-share``, a moment during the start-up
and resume itself; then it sends a random rank SIGKILL (a crash, an OOM kill) or, with probability
``--sigterm-share``, SIGTERM (a preemption: the ranks stop together, save and exit 143, and torchrun
restarts them). Every kill is logged (attempt, rank, signal, step, wall time); the seed is printed and
the same seed draws the same kills (the moments in wall time depend on the machine). A job that ends
unfinished anyway is started again with the same command (a "relaunch", reported); a run that logs
no step for ``--hang-s`` seconds is a hang, reported and stopped.

    python benchmarks/soak_kills.py                                # 1,000 steps, a kill every ~40
    python benchmarks/soak_kills.py --steps 200 --kill-every 20 --seed 7 --run-dir /tmp/soak --keep
    python benchmarks/soak_kills.py --compare SOAK_RUN_DIR REFERENCE_RUN_DIR   # only the comparison

Exit status 0 when everything matched, 1 on any difference or hang (listed). Linux only: the workers
are found as the children of the launcher through ``/proc``. docs/checkpoints.md, "Soak", has a record.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# fp32 + train.deterministic: resumes are bit-exact on CPU (docs/checkpoints.md, "Resume rules");
# tiny-v3 keeps MoE, MTP and the V3 balancing bias in the state; a save every 5 steps, async, so that
# most moments fall inside a save's write or commit; an evaluation every 25 steps.
SETTINGS = [
    "model.preset=tiny-v3",
    "train.seq_len=32",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "precision.dtype=fp32",
    "train.deterministic=true",
    "optim.warmup_steps=5",
    "train.eval_interval=25",
    "checkpoint.interval=5",
    "checkpoint.async_save=true",
    "run.progress_bar=false",
    "metrics.tensorboard=false",
]
NPROC = 2
NOT_COMPARED_PREFIXES = ("mem_",)  # memory and timings differ from run to run; the rest must not
NOT_COMPARED = {"time", "tokens_per_s", "mfu"}
STATE_KEYS = ("step", "scheduler", "scaler", "data", "faults")


def compared(record: dict) -> dict:
    return {
        k: v
        for k, v in record.items()
        if k not in NOT_COMPARED and not k.endswith("_s") and not k.startswith(NOT_COMPARED_PREFIXES)
    }


# ---------------------------------------------------------------- running and killing


def command(run_dir: Path, steps: int, max_restarts: int, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "seektrain.cli.main", "train", "--nproc-per-node", str(NPROC)]
    argv += [
        "--max-restarts",
        str(max_restarts),
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"train.steps={steps}",
    ]
    for item in (*SETTINGS, *extra):
        argv += ["--set", item]
    return argv


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    with open(log, "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def workers(agent: int) -> dict[int, tuple[int, int]]:
    """rank -> (pid, attempt) of the live workers torchrun (inside the CLI process ``agent``) started."""
    found = {}
    try:
        children = " ".join(p.read_text() for p in Path(f"/proc/{agent}/task").glob("*/children")).split()
    except OSError:
        return found
    for pid in map(int, children):
        try:
            env = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                if "=" in item
            )
            alive = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] not in "ZX"
        except (OSError, ValueError):
            continue
        if alive and "RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:
            found[int(env["RANK"])] = (pid, int(env["TORCHELASTIC_RESTART_COUNT"]))
    return found


def logged_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return records


class Soak:
    """One run under kills: starts it, kills it as drawn, restarts it when the whole job ends early."""

    def __init__(self, args, run_dir: Path, log: Path):
        self.args, self.run_dir, self.log = args, run_dir, log
        self.rng = random.Random(args.seed)
        self.kills: list[dict] = []
        self.relaunches: list[dict] = []
        self.problems: list[str] = []
        self.attempts_seen = 0  # workers of attempts 0 .. n-1 of this torchrun have been seen
        self.restarts = 0  # attempts after the first, over all relaunches
        self.t0 = time.monotonic()
        self.proc: subprocess.Popen | None = None  # the soak job now running
        self.startup_s = 20.0  # measured on the first attempt
        # torchrun may restart as often as we could kill, so that a job ends only when it is done
        self.argv = command(run_dir, args.steps, 4 * args.steps // args.kill_every + 20, args.set)

    def note(self, text: str) -> None:
        print(f"soak {time.strftime('%H:%M:%S')} {text}", flush=True)

    def run(self) -> None:
        proc = self.proc = start(self.argv, self.log)
        while True:
            outcome = self.attempt(proc)
            if outcome == "done":
                return
            if outcome == "hang" or len(self.relaunches) >= self.args.max_relaunches:
                stop(proc)
                if outcome != "hang":
                    self.problems.append(f"the job ended unfinished {len(self.relaunches)} times; gave up")
                return
            if outcome == "ended":
                rc = proc.returncode
                self.relaunches.append({"after_kills": len(self.kills), "exit": rc, "wall_s": self.elapsed()})
                self.note(f"the job ended with status {rc} before step {self.args.steps}: relaunching it")
                self.attempts_seen = 0  # a new torchrun counts its attempts from 0 again
                proc = self.proc = start(self.argv, self.log)

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def attempt(self, proc: subprocess.Popen) -> str:
        """Wait for this attempt's workers, kill one as drawn; 'next' (killed, wait for the next attempt),
        'done' (the job finished every step), 'ended' (it ended otherwise) or 'hang'."""
        spawned = time.monotonic()
        ranks = self.wait(proc, lambda: self.live_attempt(proc) is not None, "its workers to start")
        if ranks != "ok":
            return ranks
        attempt = self.live_attempt(proc)
        self.restarts += attempt > 0
        self.attempts_seen = attempt + 1
        base = len(logged_records(self.run_dir))
        if self.args.max_kills is not None and len(self.kills) >= self.args.max_kills:
            return self.wait(proc, lambda: False, "the end of the run")  # no more kills: let it finish
        if self.rng.random() < self.args.startup_share:
            delay, logged = self.rng.uniform(0, self.startup_s), 0
            time.sleep(delay)
        else:
            logged = self.rng.randint(1, 2 * self.args.kill_every)
            got = self.wait(
                proc, lambda: len(logged_records(self.run_dir)) - base >= logged, f"{logged} more steps"
            )
            if got != "ok":
                return got
            if attempt == 0 and not self.kills:
                self.startup_s = max(5.0, time.monotonic() - spawned)
            time.sleep(self.rng.uniform(0, self.args.moment_s))  # a moment inside the next step
        rank = self.rng.randrange(NPROC)
        sig = signal.SIGTERM if self.rng.random() < self.args.sigterm_share else signal.SIGKILL
        live = workers(proc.pid)
        if proc.poll() is not None or rank not in live:
            return self.ended(proc)
        records = logged_records(self.run_dir)
        os.kill(live[rank][0], sig)
        self.kills.append(
            {
                "kill": len(self.kills) + 1,
                "attempt": attempt,
                "rank": rank,
                "signal": sig.name,
                "after_step": records[-1]["step"] if len(records) > base else None,
                "attempt_logged": len(records) - base,
                "wall_s": self.elapsed(),
            }
        )
        k = self.kills[-1]
        where = f"after step {k['after_step']}" if k["after_step"] else "during start-up/resume"
        self.note(
            f"kill {k['kill']}: {sig.name} to rank {rank} of attempt {attempt} {where} (t={k['wall_s']} s)"
        )
        return "next"

    def live_attempt(self, proc: subprocess.Popen) -> int | None:
        """The attempt number when all ranks of an attempt not yet seen are alive, else None."""
        live = workers(proc.pid)
        attempts = {a for _, a in live.values()}
        if len(live) == NPROC and len(attempts) == 1 and min(attempts) >= self.attempts_seen:
            return attempts.pop()
        return None

    def wait(self, proc: subprocess.Popen, ready, what: str) -> str:
        """'ok' once ``ready()``; 'done'/'ended' if the job exits first; 'hang' if nothing is logged for
        ``--hang-s`` seconds."""
        last_change, last_len = time.monotonic(), -1
        while not ready():
            if proc.poll() is not None:
                return self.ended(proc)
            n = len(logged_records(self.run_dir))
            if n != last_len:
                last_change, last_len = time.monotonic(), n
            if time.monotonic() - last_change > self.args.hang_s:
                self.problems.append(
                    f"hang: nothing logged for {self.args.hang_s:g} s while waiting for {what} "
                    f"(after {len(self.kills)} kills; see {self.log})"
                )
                return "hang"
            time.sleep(0.1)
        return "ok"

    def ended(self, proc: subprocess.Popen) -> str:
        proc.wait()
        records = logged_records(self.run_dir)
        finished = proc.returncode == 0 and records and records[-1]["step"] == self.args.steps
        return "done" if finished else "ended"


def stop(proc: subprocess.Popen) -> None:
    """End a job this script started: the launcher's session, and its workers (torchrun starts each
    worker in a session of its own, so they would outlive the launcher)."""
    if proc.poll() is None:
        live = workers(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid, _ in live.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


# ---------------------------------------------------------------- comparing


def compare(soak: Path, reference: Path, steps: int | None = None) -> tuple[list[str], dict]:
    """(problems, figures) of the soak run against the uninterrupted one; no problems = the same run."""
    from seektrain.checkpoint.export import read_all_tensors
    from seektrain.checkpoint.finder import CHECKPOINTS, complete_checkpoints, step_dir_name, verify

    problems: list[str] = []
    differing: dict[str, int] = {}  # metric -> steps where it differs (from the reference or itself)
    ref_records, soak_records = logged_records(reference), logged_records(soak)
    ref = {r["step"]: compared(r) for r in ref_records}
    steps = steps or max(ref, default=0)
    if sorted(ref) != list(range(1, steps + 1)) or len(ref_records) != steps:
        problems.append(f"the reference run did not log steps 1..{steps} once each")
    first: dict[int, dict] = {}
    last: dict[int, dict] = {}
    recomputed = set()
    for r in map(compared, soak_records):
        s = r["step"]
        if s in first and r != first[s]:
            keys = sorted(k for k in r.keys() | first[s].keys() if r.get(k) != first[s].get(k))
            differing.update({k: differing.get(k, 0) + 1 for k in keys})
            problems.append(f"step {s} recomputed after a restart differs from its first computation: {keys}")
        if s in first:
            recomputed.add(s)
        first.setdefault(s, r)
        last[s] = r
    missing = sorted(set(ref) - set(last))
    if missing:
        problems.append(
            f"the soak run never logged steps {missing[:10]}{' ...' if len(missing) > 10 else ''}"
        )
    loss_diff = 0.0
    for s in sorted(set(ref) & set(last)):
        if last[s] != ref[s]:
            keys = sorted(k for k in last[s].keys() | ref[s].keys() if last[s].get(k) != ref[s].get(k))
            differing.update({k: differing.get(k, 0) + 1 for k in keys})
            problems.append(f"step {s} differs from the uninterrupted run: {keys}")
        loss_diff = max(loss_diff, abs(last[s]["loss"] - ref[s]["loss"]))
    figures = {
        "records": len(soak_records),
        "recomputed_steps": len(recomputed),
        "loss_max_abs_diff": loss_diff,
        "metrics_differing": differing or "none",
    }
    for name, run in (("soak", soak), ("reference", reference)):
        left = [p.name for p in (run / CHECKPOINTS).glob("step-*.tmp")] + [
            p.name for p in (run / CHECKPOINTS).glob("*.corrupt")
        ]
        if left:
            problems.append(f"the {name} run left {left} in {run / CHECKPOINTS}")
    a, b = (run / CHECKPOINTS / step_dir_name(steps) for run in (soak, reference))
    if not all(c in complete_checkpoints(c.parent) for c in (a, b)):
        problems.append(f"a final checkpoint is missing: {a} or {b}")
        return problems, figures
    for c in (a, b):
        bad = verify(c)
        if bad:
            problems.append(f"final checkpoint fails its checksums: {bad}")
    ta, tb = read_all_tensors(a), read_all_tensors(b)
    if ta.keys() != tb.keys():
        problems.append(f"the final checkpoints hold different tensors: {sorted(ta.keys() ^ tb.keys())[:10]}")
    differ, worst = [], 0.0
    for k in sorted(ta.keys() & tb.keys()):
        if not torch_equal(ta[k], tb[k]):
            differ.append(k)
            worst = max(worst, (ta[k].double() - tb[k].double()).abs().max().item())
    if differ:
        problems.append(f"{len(differ)} of {len(ta)} tensors differ bit-wise, e.g. {differ[:5]}")
    sa, sb = (json.loads((c / "trainer_state.json").read_text()) for c in (a, b))
    for key in STATE_KEYS:
        if sa.get(key) != sb.get(key):
            problems.append(f"trainer_state.json field {key!r} differs")
    figures.update(tensors=len(ta), tensors_differing=len(differ), param_max_abs_diff=worst)
    return problems, figures


def torch_equal(x, y) -> bool:
    """Bit-wise: same dtype, shape and bytes (so -0.0 differs from 0.0, and a NaN equals itself)."""
    return (
        x.dtype == y.dtype
        and x.shape == y.shape
        and x.contiguous().reshape(-1).view(torch.uint8).equal(y.contiguous().reshape(-1).view(torch.uint8))
    )


# ---------------------------------------------------------------- main


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--kill-every", type=int, default=40, help="mean steps an attempt logs before a kill")
    p.add_argument("--seed", type=int, default=None, help="draws the kills (default: a random one, printed)")
    p.add_argument("--sigterm-share", type=float, default=0.25, help="share of kills that are SIGTERM")
    p.add_argument("--startup-share", type=float, default=0.1, help="share of kills during start-up/resume")
    p.add_argument("--moment-s", type=float, default=0.5, help="a kill lands up to this long after a step")
    p.add_argument("--hang-s", type=float, default=300, help="nothing logged this long = a hang")
    p.add_argument("--max-kills", type=int, default=None, help="stop killing after this many")
    p.add_argument("--max-relaunches", type=int, default=3)
    p.add_argument("--run-dir", type=Path, default=None, help="where both runs go (default: a temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the run folders (always kept on a failure)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for both runs")
    p.add_argument(
        "--reference-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="for the uninterrupted run only (a planted difference: the soak must then fail)",
    )
    p.add_argument(
        "--compare", nargs=2, type=Path, metavar=("SOAK", "REFERENCE"), help="only compare two runs"
    )
    args = p.parse_args(argv)
    if args.kill_every < 1 or args.steps < 1:
        p.error("--steps and --kill-every must be >= 1")
    return args


def report(problems: list[str], figures: dict) -> int:
    for key, value in figures.items():
        print(f"  {key:20} {value}")
    for line in problems:
        print(f"DIFFERENCE: {line}")
    print("soak: PASS (identical to the uninterrupted run)" if not problems else "soak: FAIL")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.compare:
        problems, figures = compare(*args.compare)
        return report(problems, figures)
    args.seed = random.randrange(2**31) if args.seed is None else args.seed
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="soak-"))
    soak_dir, ref_dir = root / "soak", root / "reference"
    for d in (soak_dir, ref_dir):
        if d.exists():
            shutil.rmtree(d)
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"soak: seed {args.seed}, {args.steps} steps, a kill every ~{args.kill_every} steps, "
        f"{NPROC} processes, torch {torch.__version__}, python {platform.python_version()}, in {root}",
        flush=True,
    )
    soak = Soak(args, soak_dir, root / "soak.log")
    reference = start(command(ref_dir, args.steps, 0, args.set + args.reference_set), root / "reference.log")
    # a SIGTERM to this script (a `timeout`, a scheduler) ends both jobs and their workers, as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        soak.run()
        reference.wait()
    finally:
        for job in (soak.proc, reference):
            if job is not None:
                stop(job)
    wall = soak.elapsed()
    problems = list(soak.problems)
    if reference.returncode != 0:
        problems.append(
            f"the uninterrupted run failed (status {reference.returncode}; {root / 'reference.log'})"
        )
    figures = {"seed": args.seed, "steps": args.steps, "kills": len(soak.kills)}
    for sig in ("SIGKILL", "SIGTERM"):
        for rank in range(NPROC):
            figures[f"{sig} rank {rank}"] = sum(k["signal"] == sig and k["rank"] == rank for k in soak.kills)
    figures["during start-up"] = sum(k["after_step"] is None for k in soak.kills)
    figures.update(restarts=soak.restarts, relaunches=len(soak.relaunches), wall_s=wall)
    if not soak.problems:
        found, compared_figures = compare(soak_dir, ref_dir, args.steps)
        problems += found
        figures.update(compared_figures)
    summary = {"figures": figures, "problems": problems, "kills": soak.kills, "relaunches": soak.relaunches}
    (root / "soak.json").write_text(json.dumps(summary, indent=1))
    code = report(problems, figures)
    if args.keep or problems or args.run_dir:
        print(f"soak: runs, logs and soak.json kept in {root}")
    else:
        shutil.rmtree(root)
    return code


if __name__ == "__main__":
    sys.exit(main())
