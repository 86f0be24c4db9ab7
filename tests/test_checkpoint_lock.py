"""Who may change a run dir: a ``step-N.tmp`` that a live process is writing is never touched (its writer
holds an flock), a stale one is removed by the trainer's rank 0 only, and ``sample`` / ``convert`` only
read (nothing is moved or deleted, not even a corrupt checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from run_cli import seektrain, train
from seektrain.checkpoint import write_lock
from seektrain.checkpoint.export import load_run_checkpoint
from seektrain.checkpoint.finder import CHECKPOINTS, resolve_checkpoint
from seektrain.checkpoint.manager import CheckpointError, CheckpointManager
from seektrain.checkpoint.resume import prepare_run_dir, resolve_resume
from seektrain.checkpoint.run_files import MODEL_CONFIG
from seektrain.models import build_model, get_preset

DENSE = get_preset("tiny-dense")
_HOLD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from seektrain.checkpoint.write_lock import create_locked
    lock = create_locked(Path(sys.argv[1]))
    print("locked", flush=True)
    sys.stdin.read()  # hold the lock until the test closes our stdin
""")


class Writer:
    """Another process writing a ``.tmp`` folder: it creates it with its lock held and keeps it."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout.readline().strip() == "locked"

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def writers():
    started: list[Writer] = []
    yield lambda path: started.append(Writer(path)) or started[-1]
    for w in started:
        if w.proc.poll() is None:
            w.stop()


def stale_tmp(path: Path) -> Path:
    """A ``.tmp`` whose writer is gone (created with the lock, then the lock dropped)."""
    write_lock.create_locked(path).release()
    (path / "__0_0.distcp").write_bytes(b"half a shard")
    return path


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def busy_run(run: Path, writers) -> tuple[Path, Path]:
    """Checkpoints 2 (good) and 3 (corrupt), a stale step-4.tmp and a live step-5.tmp."""
    run.mkdir(parents=True, exist_ok=True)
    (run / MODEL_CONFIG).write_text(json.dumps(DENSE.to_dict()))
    manager = CheckpointManager(run, keep=10, async_save=False, rank=0)
    for step in (2, 3):
        manager.save(step, build_model(DENSE, seed=0), None, {"step": step})
    shard = next((run / CHECKPOINTS / "step-00000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    live = run / CHECKPOINTS / "step-00000005.tmp"
    writers(live)
    return stale_tmp(run / CHECKPOINTS / "step-00000004.tmp"), live


def test_the_lock_lives_as_long_as_its_writer(tmp_path, writers):
    tmp = tmp_path / "step-00000001.tmp"
    writer = writers(tmp)
    assert write_lock.in_use(tmp) and str(writer.proc.pid) in write_lock.holder(tmp)
    assert not write_lock.remove_if_stale(tmp) and tmp.is_dir()
    writer.stop()
    assert not write_lock.in_use(tmp)
    assert write_lock.remove_if_stale(tmp) and not tmp.exists()
    assert not list(tmp_path.iterdir())  # no staging folder left behind either


def test_only_the_trainers_rank_0_tidies_and_never_a_live_tmp(tmp_path, writers):
    run = tmp_path / "run"
    stale, live = busy_run(run, writers)
    before = snapshot(run)
    assert CheckpointManager(run, keep=2, async_save=False, rank=1).latest_valid() is None
    assert snapshot(run) == before  # rank 1 changes nothing
    chosen = CheckpointManager(run, keep=2, async_save=False, rank=0).latest_valid()
    assert chosen == run / CHECKPOINTS / "step-00000002"
    assert sorted(p.name for p in (run / CHECKPOINTS).iterdir()) == [
        "step-00000002",
        "step-00000003.corrupt",
        "step-00000005.tmp",
    ]
    assert write_lock.in_use(live) and not stale.exists()


def test_resume_choice_on_rank_0_keeps_a_live_tmp(tmp_path, writers):
    run = tmp_path / "run"
    stale, live = busy_run(run, writers)
    choice = CheckpointManager(run, keep=2, async_save=False, rank=0).resume_choice("auto", DENSE)
    assert choice.checkpoint == run / CHECKPOINTS / "step-00000002" and choice.set_aside == ()
    assert live.is_dir() and not stale.exists()
    with pytest.raises(
        ValueError,
        match=r"step-00000005.tmp is being written by another process .*; stop the "
        r"job using this run.dir first, or use a new run.dir$",
    ):
        prepare_run_dir(run, resolve_resume(run, "never", DENSE))
    assert live.is_dir() and (run / CHECKPOINTS / "step-00000002").is_dir()


def test_sample_and_convert_only_read(tmp_path, writers):
    run = tmp_path / "run"
    busy_run(run, writers)
    before = snapshot(run)
    assert resolve_checkpoint(run) == run / CHECKPOINTS / "step-00000002"  # skips the corrupt step 3
    model, path = load_run_checkpoint(run)  # seektrain convert --from-checkpoint RUN
    assert path == run / CHECKPOINTS / "step-00000002" and model.cfg == DENSE
    with pytest.raises(ValueError, match="is unusable"):
        load_run_checkpoint(run / CHECKPOINTS / "step-00000003")
    assert snapshot(run) == before


def test_a_save_never_takes_over_a_live_tmp(tmp_path, writers):
    manager = CheckpointManager(tmp_path, keep=5, async_save=False, rank=0)
    model = build_model(DENSE, seed=0)
    writers(tmp_path / CHECKPOINTS / "step-00000005.tmp")
    with pytest.raises(CheckpointError) as err:
        manager.save(5, model, None, {"step": 5})
    text = str(err.value)
    assert (
        "\n" not in text and "another process" in text and text.endswith("two jobs must not share a run.dir")
    )
    stale_tmp(tmp_path / CHECKPOINTS / "step-00000006.tmp")
    manager.save(6, model, None, {"step": 6})  # a crashed save's leftover is replaced
    done = tmp_path / CHECKPOINTS / "step-00000006"
    assert not (done / write_lock.LOCK).exists() and "__0_0.distcp" in os.listdir(done)
    assert write_lock.LOCK not in (done / "checksums.json").read_text()


def test_sample_and_a_trainer_start_keep_a_live_tmp(tmp_path, writers):
    """Through the real CLI: `seektrain sample` reads around a live and a stale .tmp and changes nothing;
    the next `seektrain train` on the run dir removes the stale one and resumes, leaving the live one;
    and a run that asks for another model over the run's checkpoints is refused with one line."""
    run = tmp_path / "run"
    train(run, "train.steps=2", "model.preset=tiny-dense")
    live = run / CHECKPOINTS / "step-00000009.tmp"
    writers(live)
    stale = stale_tmp(run / CHECKPOINTS / "step-00000008.tmp")
    before = snapshot(run / CHECKPOINTS)
    out = seektrain("sample", "--run", str(run), "--prompt", "def ", "--max-new-tokens", "3")
    assert out.stdout.startswith(f"# {run / CHECKPOINTS / 'step-00000002'}")
    assert snapshot(run / CHECKPOINTS) == before
    proc = train(run, "train.steps=3", "model.preset=tiny-dense")
    assert "resumed from" in proc.stdout + proc.stderr
    assert live.is_dir() and write_lock.in_use(live) and not stale.exists()
    refused = train(run, "train.steps=4", "model.preset=tiny-v3", check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("seektrain:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-2000:]
    assert "holds model 'tiny-dense' but the config asks for model 'tiny-v3'" in errors[0]
    assert errors[0].endswith("use a new run.dir, or checkpoint.resume=never to start fresh in this one")
