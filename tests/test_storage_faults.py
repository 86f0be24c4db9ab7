"""Storage faults of a 2-process `seektrain train` (issue 22): a run.dir one rank does not share stops the
job before step 1 with one line naming the node; a full disk under `checkpoint.on_write_error=continue`
skips that checkpoint, says the disk is full, and the next interval saves again."""

from __future__ import annotations

import socket

import pytest

from fault_injection import hooks_env
from run_cli import metrics, train


def test_a_rank_that_does_not_see_run_dir_stops_the_job_before_step_1(tmp_path):
    run = tmp_path / "run"
    proc = train(
        run, "train.steps=2", nproc=2, env=hooks_env({"SEEKTRAIN_TEST_UNSHARED_RUN_DIR": "1"}), check=False
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "is not shared" in line]
    assert lines, proc.stderr[-3000:]
    assert f"run.dir={run} is not shared: rank 1 on node {socket.gethostname()}" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (run / "metrics.jsonl").exists() or not metrics(run)  # no step ran
    assert not list(run.glob(".seektrain-shared-*"))  # the marker is removed


@pytest.mark.slow  # ~100 s here; tests/test_checkpoint_unit.py holds `continue` (sync and async) in CI
def test_continue_skips_a_checkpoint_the_full_disk_refused_and_saves_at_the_next_interval(tmp_path):
    """Only rank 1's write of step 2 hits ENOSPC (DCP reports it to every rank); rank 0's line says the
    disk is full, training goes on, step 3 is saved."""
    run = tmp_path / "run"
    train(
        run,
        "train.steps=4",
        "checkpoint.interval=1",
        "checkpoint.keep=5",
        "checkpoint.on_write_error=continue",
        nproc=2,
        env=hooks_env({"SEEKTRAIN_TEST_CKPT_ENOSPC": "2:1"}),
    )
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-00000001", "step-00000003", "step-00000004"]  # no step 2, no .tmp
    log = (run / "train.log").read_text()
    warned = [line for line in log.splitlines() if "on_write_error=continue" in line]
    assert len(warned) == 1 and "the disk holding run.dir is full" in warned[0], log[-3000:]
    assert "[rank0] WARNING" in warned[0] and "step-00000002.tmp" in warned[0]


def _two_ranks(rank: int, out_dir: str) -> None:
    """Rank 1 looks at its own folder for run.dir; then rank 1 alone cannot write its RNG file (ENOSPC),
    a failure that happens before DCP's collectives and so is known to rank 1 only."""
    import errno
    import os
    from pathlib import Path

    from seektrain.checkpoint import rng
    from seektrain.checkpoint.manager import CheckpointManager
    from seektrain.checkpoint.shared_dir import check_shared_run_dir
    from seektrain.errors import UserError
    from test_checkpoint_unit import tiny

    out = Path(out_dir)
    manager = CheckpointManager(out / "run", keep=5, async_save=False, rank=rank)
    lines = []
    try:
        check_shared_run_dir(out / ("run" if rank == 0 else "elsewhere"), rank, manager.group)
    except UserError as err:
        lines.append(str(err))
    write = rng.write

    def full_on_rank_1(path, rank_, states):
        if rank_ == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write(path, rank_, states)

    rng.write = full_on_rank_1
    model, optimizer = tiny()
    try:
        manager.save(1, model, optimizer, {"step": 1})
    except Exception as err:
        lines.append(str(err))
    (out / f"rank{rank}.txt").write_text("\n".join(lines))


def test_every_rank_names_the_blind_node_and_the_full_disk(tmp_path):
    from spawn_ranks import spawn_ranks

    spawn_ranks(_two_ranks, 2, str(tmp_path))
    said = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    assert said[0][0] == said[1][0] and len(said[0]) == len(said[1]) == 2
    assert said[0][0].startswith(f"run.dir={tmp_path / 'run'} is not shared: rank 1 on node ")
    assert f"(its run.dir: {tmp_path / 'elsewhere'})" in said[0][0]
    for lines in said:  # rank 0 too, though its own write was fine
        assert "the disk holding run.dir is full" in lines[1] and "step-00000001.tmp" in lines[1]
