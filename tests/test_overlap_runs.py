"""What overlaps training, end to end through the real CLI (one process, CPU, fp32, deterministic):
batches read ahead by a thread (``data.prefetch``) and checkpoints written in the background
(``checkpoint.async_save``) change no batch, loss, checkpoint or resume; an error in the read-ahead
thread reaches the user as the same one line at the same step; the training thread's checkpoint time
is in the metrics and the summary.

Every run takes 4 steps with a checkpoint every 2; the run without read-ahead and with sync saves is
the reference.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from run_cli import train
from test_checkpoint_runs import same_contents, step_losses

RUN = ["train.steps=4", "checkpoint.interval=2", "train.deterministic=true"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("plain")
    train(run, *RUN, "data.prefetch=0")
    return run


@pytest.fixture(scope="module")
def ahead(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ahead")
    train(run, *RUN, "data.prefetch=3", "checkpoint.async_save=true")
    return run


def test_read_ahead_and_async_saves_change_no_batch_loss_or_checkpoint(plain, ahead):
    """Same losses bit for bit, and the same checkpoints, whose data position counts the batches trained
    on (step 2 × 4 windows), not the ones the thread had read ahead."""
    assert step_losses(ahead) == step_losses(plain) and sorted(step_losses(plain)) == [1, 2, 3, 4]
    for step in ("step-00000002", "step-00000004"):
        same_contents(ahead / "checkpoints" / step, plain / "checkpoints" / step)
    import json

    state = json.loads((ahead / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["data"]["consumed_windows"] == 8


def test_resume_with_read_ahead_equals_the_uninterrupted_run(plain, ahead, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ahead, run)
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    (run / "metrics.jsonl").unlink()
    proc = train(run, *RUN, "data.prefetch=3", "checkpoint.async_save=true")
    assert "step-00000002 at step 2" in proc.stdout + proc.stderr
    resumed, reference = step_losses(run), step_losses(plain)
    assert sorted(resumed) == [3, 4] and [resumed[s] for s in (3, 4)] == [reference[s] for s in (3, 4)]
    same_contents(run / "checkpoints" / "step-00000004", plain / "checkpoints" / "step-00000004")


def test_the_checkpoint_stall_is_logged_at_its_step_and_summarised(plain, ahead):
    """The step that saves (2) logs the training thread's time in the save as ``checkpoint_stall_s``
    (async: the copy to host memory; its commit lands at the first step that finds the write done); a
    step that neither saves nor commits logs nothing; the summary adds them up. The final checkpoint
    is written after the last step."""
    import json

    from run_cli import metrics

    for run in (plain, ahead):
        stalls = {m["step"]: m["checkpoint_stall_s"] for m in metrics(run) if "checkpoint_stall_s" in m}
        assert 2 in stalls and 1 not in stalls and all(s > 0 for s in stalls.values()), stalls
        summary = json.loads((run / "summary.json").read_text())
        assert summary["checkpoint_stalls"] == len(stalls)
        assert summary["checkpoint_stall_s_total"] == pytest.approx(sum(stalls.values()))


_FAILING_LOADER = textwrap.dedent("""
    import sys, threading
    from seektrain.data.batch_loader import DistributedBatchLoader
    from seektrain.errors import UserError
    read = DistributedBatchLoader.__next__
    def failing(self):  # batch 5, step 3's first (2 micro-batches a step), cannot be read, as from a bad shard
        if self.consumed_windows >= 4 * self.global_batch:
            raise UserError(f"data.path={self.dataset.directory}: shard-00000.bin cannot be read; re-run "
                             "`seektrain data prepare ... --force`")
        return read(self)
    DistributedBatchLoader.__next__ = failing
    from seektrain.cli.main import main
    code = main(sys.argv[1:])
    alive = [t.name for t in threading.enumerate() if t.name.startswith("seektrain-")]
    print("threads left:", alive)
    sys.exit(code)
""")


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loader_error_is_one_line_at_its_step(tmp_path, prefetch):
    """The loader fails on step 3's batch: with read-ahead the thread meets it during step 2, but the
    run still completes step 2 and stops at step 3 with the loader's own line, and no thread is left."""
    from run_cli import TINY, metrics

    args = ["train", "--set", f"run.dir={tmp_path}"]
    for item in (*TINY, "train.steps=4", f"data.prefetch={prefetch}"):
        args += ["--set", item]
    proc = subprocess.run(
        [sys.executable, "-c", _FAILING_LOADER, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("seektrain:")]
    assert len(errors) == 1 and errors[0].startswith("seektrain: error: data.path=")
    assert errors[0].endswith("shard-00000.bin cannot be read; re-run `seektrain data prepare ... --force`")
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    assert "threads left: []" in proc.stdout


_PREEMPTED = textwrap.dedent("""
    import os, signal, sys, threading
    import seektrain.train.trainer as trainer
    step_once = trainer.train_step
    def train_step(ctx, step):  # SIGTERM arrives during step 2, as from a preempting scheduler
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_once(ctx, step)
    trainer.train_step = train_step
    from seektrain.cli.main import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as done:
        code = done.code
    alive = [t.name for t in threading.enumerate() if t.name.startswith("seektrain-")]
    print("threads left:", alive)
    sys.exit(code)
""")


def test_preemption_stops_the_threads(tmp_path):
    """SIGTERM during step 2 with read-ahead and async saves: the run saves step 2, exits with 143 and
    leaves no prefetch, checkpoint-write or pruning thread behind."""
    from run_cli import TINY

    args = ["train", "--set", f"run.dir={tmp_path}"]
    for item in (
        *TINY,
        "train.steps=6",
        "data.prefetch=2",
        "checkpoint.async_save=true",
        "checkpoint.interval=1",
    ):
        args += ["--set", item]
    proc = subprocess.run(
        [sys.executable, "-c", _PREEMPTED, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert "threads left: []" in proc.stdout
