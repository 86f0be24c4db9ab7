"""SIGTERM at the moments a cluster may send it besides a training step: during a sync save, during an
async save still in flight, during an evaluation and during start-up (the checkpoint load of a resume).

One run folder is interrupted four times in a row, each time by a `seektrain train` of 2 processes with a
test hook that sends SIGTERM to the launcher (which forwards it to both workers, as torchrun does) at that
moment (tests/fault_injection.py); each interrupted run resumes the folder the previous one left. Every
stage must exit 143 with the one `seektrain: preempted: ...` line naming what run.dir holds, leave no
`.tmp` folder and no lock, keep every earlier checkpoint byte for byte, and train exactly the steps an
uninterrupted run trains (its losses, and the checkpoint the last stage saved, equal the reference's).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from fault_injection import hooks_env
from run_cli import metrics, train
from test_checkpoint_runs import same_contents, step_losses

STEPS = [
    "train.steps=8",
    "checkpoint.interval=2",
    "checkpoint.keep=10",
    "train.eval_interval=6",  # evaluations after steps 6 and 8
    "train.eval_steps=2",
    "train.deterministic=true",
]
PREEMPTED = "seektrain: preempted: "
# (name, extra --set items, SIGTERM hook) in the order the folder meets them
STAGES = [
    ("sync save", [], hooks_env({"SEEKTRAIN_TEST_SIGTERM_SAVE": "2:0"})),
    ("start-up", [], hooks_env({"SEEKTRAIN_TEST_SIGTERM_STARTUP": "resume:0"})),
    ("async save", ["checkpoint.async_save=true"], hooks_env({"SEEKTRAIN_TEST_SIGTERM_SAVE": "4:0"})),
    ("eval", [], hooks_env({"SEEKTRAIN_TEST_SIGTERM_EVAL": "6:0"})),
]


def files(run: Path) -> dict[str, str]:
    """sha256 of every file under run.dir/checkpoints, by relative path."""
    root = run / "checkpoints"
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    train(run, *STEPS, nproc=2)
    return run


class Chain:
    """The interrupted folder; ``stage(name)`` runs the stages up to ``name`` once (so ``-k`` one test
    spawns only the stages before it) and returns its exit status, lines, checkpoints and files."""

    def __init__(self, run: Path):
        self.run, self.seen = run, {}

    def stage(self, name: str) -> dict:
        for stage, extra, hook in STAGES:
            if stage not in self.seen:
                self.seen[stage] = self._interrupt(extra, hook)
            if stage == name:
                return self.seen[name]
        raise KeyError(name)

    def _interrupt(self, extra: list[str], hook: dict) -> dict:
        run = self.run
        before = files(run) if (run / "checkpoints").is_dir() else {}
        metrics_before = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").is_file() else ""
        proc = train(run, *STEPS, *extra, nproc=2, env=hook, check=False, timeout=600)
        return {
            "rc": proc.returncode,
            "lines": [line for line in proc.stderr.splitlines() if line.startswith("seektrain:")],
            "out": proc.stdout[-3000:] + proc.stderr[-3000:],
            "before": before,
            "after": files(run),
            "checkpoints": checkpoints(run),
            "metrics_before": metrics_before,
            "metrics_after": (run / "metrics.jsonl").read_text(),
        }


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain:
    return Chain(tmp_path_factory.mktemp("interrupted") / "run")


def assert_kept_and_clean(stage: dict) -> None:
    """Every file of the checkpoints there before is still there, unchanged; no .tmp, no lock."""
    after = stage["after"]
    assert {k: after.get(k) for k in stage["before"]} == stage["before"]
    assert not [c for c in stage["checkpoints"] if not c.startswith("step-") or "." in c]
    assert not [k for k in after if k.endswith("/.lock")], "a write lock was left in a checkpoint"


def assert_saved(stage: dict, run: Path, step: int, note: str = "") -> None:
    ckpt = run / "checkpoints" / f"step-{step:08d}"
    assert stage["rc"] == 143, stage["out"]
    assert stage["lines"] == [
        f"{PREEMPTED}stopped after step {step} and saved {ckpt}{note}; run the same command again to resume"
    ], stage["out"]
    assert_kept_and_clean(stage)
    assert (ckpt / "COMPLETE").is_file()


def test_sigterm_during_a_sync_save_commits_it_and_stops_there(chain):
    """The save of step 2 is committed, and, every rank having seen the signal by then, it is the
    preemption checkpoint: no step 3."""
    run, stage = chain.run, chain.stage("sync save")
    assert_saved(stage, run, 2)
    assert stage["checkpoints"] == ["step-00000002"]


def test_sigterm_during_start_up_writes_nothing_and_the_folder_resumes(chain):
    """Preempted while loading the checkpoint to resume from: nothing trained, nothing written, the
    checkpoint and metrics untouched; the next stage resumes from it (its losses are checked there)."""
    run, stage = chain.run, chain.stage("start-up")
    ckpt = run / "checkpoints" / "step-00000002"
    assert stage["rc"] == 143, stage["out"]
    assert stage["lines"] == [
        f"{PREEMPTED}SIGTERM during start-up (loading checkpoint {ckpt}): nothing was trained, so no "
        f"checkpoint was written; run.dir resumes from {ckpt}: run the same command again"
    ], stage["out"]
    assert stage["after"] == stage["before"]
    assert stage["metrics_after"] == stage["metrics_before"]


def test_sigterm_during_an_async_save_commits_it_and_saves_the_next_step(chain):
    """The async save of step 4 is still being written when the signal comes: it is committed, and
    the step at which every rank stops (5) is saved too."""
    run, stage = chain.run, chain.stage("async save")
    assert_saved(stage, run, 5)
    assert stage["checkpoints"] == ["step-00000002", "step-00000004", "step-00000005"]


def test_sigterm_during_an_evaluation_abandons_it_and_saves_the_step(chain, reference):
    """The evaluation after step 6 gives way; step 6 is saved, equal to the uninterrupted run's, and
    every step any stage trained has the uninterrupted run's loss."""
    run, stage = chain.run, chain.stage("eval")
    note = " (the evaluation after step 6 was abandoned: no val_loss for it)"
    assert_saved(stage, run, 6, note)
    by_step = {m["step"]: m for m in metrics(run)}
    assert "val_loss" not in by_step[6]
    assert step_losses(run) == {s: v for s, v in step_losses(reference).items() if s <= 6}
    same_contents(run / "checkpoints/step-00000006", reference / "checkpoints/step-00000006")


@pytest.mark.slow
def test_the_interrupted_folder_finishes_like_the_uninterrupted_run(chain, reference, tmp_path):
    """The last stage's folder, resumed once more, ends with the uninterrupted run's losses, val_loss
    and final checkpoint."""
    run = tmp_path / "run"
    chain.stage("eval")
    shutil.copytree(chain.run, run)
    train(run, *STEPS, nproc=2)
    assert step_losses(run) == step_losses(reference)
    assert metrics(run)[-1]["val_loss"] == metrics(reference)[-1]["val_loss"]
    same_contents(run / "checkpoints/step-00000008", reference / "checkpoints/step-00000008")


def test_start_up_leaves_at_once_and_training_only_flags(tmp_path):
    """In one process: a SIGTERM inside start_up() raises Preempted there (exit 143, the line naming
    what run.dir holds); inside uninterrupted() it waits for its end; after start-up it is a flag."""
    import os
    import signal
    import time

    from seektrain.train.preemption import Preempted, Preemption

    def deliver():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs in here

    for section in ("plain", "uninterrupted"):
        preemption = Preemption(grace_s=60.0, rank=0)
        preemption.run_dir = tmp_path
        moved = []
        try:
            with pytest.raises(Preempted) as got, preemption.start_up():
                preemption.phase = "building the model"
                if section == "plain":
                    deliver()
                else:
                    with preemption.uninterrupted():
                        deliver()
                        moved.append("all")
                moved.append("after")
        finally:
            preemption.close()
        assert got.value.code == 143
        assert got.value.line == (
            "seektrain: preempted: SIGTERM during start-up (building the model): nothing was trained, "
            "so no checkpoint was written; run.dir holds no checkpoint: the same command starts the run "
            "afresh"
        )
        assert moved == ([] if section == "plain" else ["all"])
    preemption = Preemption(grace_s=60.0, rank=0)
    try:
        with preemption.start_up():
            pass
        deliver()
        assert preemption.received == signal.SIGTERM and preemption.agreed()
    finally:
        preemption.close()


def test_launcher_relays_the_preempted_line_and_exits_143(tmp_path, capsys):
    """Workers that got SIGTERM while the launcher did not (Slurm signals every task): one line, 143."""
    from types import SimpleNamespace

    from seektrain.launch.worker_errors import preempted_line, report_failures

    line = f"{PREEMPTED}stopped after step 4 and saved x/step-00000004; run the same command again to resume"
    for rank in range(2):
        (tmp_path / f"rank-{rank}.txt").write_text(line)
    assert preempted_line(tmp_path) == line
    assert report_failures({r: SimpleNamespace(exitcode=143) for r in range(2)}, tmp_path) == 143
    assert capsys.readouterr().err.splitlines() == [line + " [ranks 0, 1]"]
