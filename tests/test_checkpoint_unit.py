"""Checkpoint manager and fault handling in one process (fast): a full disk or an unwritable run dir,
async saves while training keeps changing the weights, RNG states, the MoE balancing bias under DDP
and FSDP, the bad-loss policy, and readable collective errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from fault_injection import hooks_env
from run_cli import train
from seektrain.checkpoint import rng
from seektrain.checkpoint.manager import CheckpointError, CheckpointManager, describe_error
from seektrain.checkpoint.staging import snapshot_stager, staging_options
from seektrain.config.loader import ConfigError, load_config
from seektrain.models import build_model, get_preset
from seektrain.train.collective_failure import CollectiveError
from seektrain.train.loss_guard import BadLossError, LossGuard
from seektrain.train.readable_failure import FailedAt, readable_failure


def tiny():
    model = build_model(get_preset("tiny-v3"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


def state_of(path):
    model, optimizer = tiny()
    CheckpointManager(path.parent.parent, keep=5, async_save=False, rank=0).load(path, model, optimizer)
    return model.state_dict(), optimizer.state_dict()


def test_disk_full_gives_one_line_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    model, optimizer = tiny()
    manager = CheckpointManager(tmp_path, keep=5, async_save=False, rank=0)
    manager.save(1, model, optimizer, {"step": 1})
    import errno
    import os

    from seektrain.checkpoint import manager as manager_module
    from seektrain.checkpoint.storage import Writer

    class FullDisk(Writer):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(manager_module, "Writer", FullDisk)
    with pytest.raises(CheckpointError) as err:
        manager.save(2, model, optimizer, {"step": 2})
    message = str(err.value)
    assert "\n" not in message and "No space left on device" in message and "untouched" in message
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]  # no .tmp left
    assert manager.latest_valid() == tmp_path / "checkpoints" / "step-00000001"


def test_unwritable_run_dir_gives_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model, optimizer = tiny()
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(blocker / "run", keep=2, async_save=False, rank=0).save(
            1, model, optimizer, {"step": 1}
        )
    assert "\n" not in str(err.value) and "run.dir is writable" in str(err.value)


def test_async_save_is_a_snapshot_while_training_continues(tmp_path):
    model, optimizer = tiny()
    CheckpointManager(tmp_path / "sync", keep=2, async_save=False, rank=0).save(
        3, model, optimizer, {"step": 3}
    )
    manager = CheckpointManager(tmp_path / "async", keep=2, async_save=True, rank=0)
    manager.save(3, model, optimizer, {"step": 3})
    with torch.no_grad():  # "training" goes on while the background thread writes
        for p in model.parameters():
            p.add_(1.0)
    manager.wait()
    sync_sd, sync_opt = state_of(tmp_path / "sync" / "checkpoints" / "step-00000003")
    async_sd, async_opt = state_of(tmp_path / "async" / "checkpoints" / "step-00000003")
    assert all(torch.equal(sync_sd[k], async_sd[k]) for k in sync_sd)
    assert all(
        torch.equal(a["exp_avg"], b["exp_avg"])
        for a, b in zip(sync_opt["state"].values(), async_opt["state"].values())
    )


def test_async_snapshots_reuse_their_host_buffers_and_stay_snapshots():
    """The stager of async saves keeps one host buffer per tensor storage: a second snapshot lands in the
    same memory with the new values, and changing the weights afterwards leaves it as it was."""
    model, optimizer = tiny()
    stager = snapshot_stager(pinned=False)
    try:

        def snapshot():
            model_sd, optim_sd = get_state_dict(model, optimizer)
            return stager.stage({"model": model_sd, "optim": optim_sd})

        first = snapshot()
        where = {k: t.data_ptr() for k, t in first["model"].items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        second = snapshot()
        assert {k: t.data_ptr() for k, t in second["model"].items()} == where  # reused, not reallocated
        assert all(torch.equal(second["model"][k], v) for k, v in model.state_dict().items())
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.0)
        assert not any(t.is_pinned() for t in second["model"].values())  # CPU: nothing pinned
        assert all(
            t.abs().sum() > 0 for k, t in second["model"].items() if k.endswith("weight")
        )  # a snapshot
    finally:
        stager.close()


def test_staging_pins_and_copies_asynchronously_only_with_an_accelerator():
    gpu, cpu = staging_options(pinned=True), staging_options(pinned=False)
    assert (gpu.use_pinned_memory, gpu.use_non_blocking_copy) == (True, True)
    assert (cpu.use_pinned_memory, cpu.use_non_blocking_copy) == (False, False)
    for options in (gpu, cpu):  # the writer is a thread of ours; save() returns after the copy
        assert (options.use_shared_memory, options.use_async_staging) == (False, False)


def test_async_saves_are_checksummed_in_the_background_and_their_stall_is_measured(tmp_path, monkeypatch):
    """Two async saves: each verifies (rank 0 hashed the folder on the writing thread), the training
    thread's time is reported once per save or commit; a failed checksum is one line on commit and
    leaves the earlier checkpoint alone."""
    import seektrain.checkpoint.manager as manager_module
    from seektrain.checkpoint.finder import verify

    model, optimizer = tiny()
    manager = CheckpointManager(tmp_path, keep=5, async_save=True, rank=0)
    assert manager.take_stall_s() is None
    hashed_on = []
    real_sha = manager_module.sha256_file
    monkeypatch.setattr(
        manager_module,
        "sha256_file",
        lambda p: hashed_on.append(threading.current_thread().name) or real_sha(p),
    )
    manager.save(1, model, optimizer, {"step": 1})
    assert manager.take_stall_s() > 0 and manager.take_stall_s() is None
    manager.wait()
    assert manager.take_stall_s() > 0
    assert set(hashed_on) == {"seektrain-checkpoint-write"}
    assert verify(tmp_path / "checkpoints" / "step-00000001") is None
    monkeypatch.setattr(
        manager_module, "sha256_file", lambda p: (_ for _ in ()).throw(OSError(5, "I/O error"))
    )
    manager.save(2, model, optimizer, {"step": 2})
    with pytest.raises(CheckpointError) as err:
        manager.wait()
    assert "\n" not in str(err.value) and "step-00000002.tmp failed (OSError: [Errno 5] I/O error)" in str(
        err.value
    )
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    manager.close()


def test_old_checkpoints_are_pruned_off_the_training_thread(tmp_path, monkeypatch):
    import seektrain.checkpoint.manager as manager_module

    model, optimizer = tiny()
    pruned_on = []
    real_rmtree = manager_module.shutil.rmtree
    monkeypatch.setattr(
        manager_module.shutil,
        "rmtree",
        lambda path, **kw: pruned_on.append(threading.current_thread().name) or real_rmtree(path, **kw),
    )
    manager = CheckpointManager(tmp_path, keep=1, async_save=False, rank=0)
    for step in (1, 2, 3):
        manager.save(step, model, optimizer, {"step": step})
    manager.close()  # waits for the last pruning
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]
    assert pruned_on == ["seektrain-checkpoint-prune"] * 2


def test_rng_state_round_trips_as_raw_bytes(tmp_path):
    torch.manual_seed(7)
    rng.write(tmp_path, 3, rng.capture())
    expected = torch.rand(4)
    torch.manual_seed(99)
    assert rng.restore(tmp_path, 3) and torch.equal(torch.rand(4), expected)
    assert not rng.restore(tmp_path, 4)  # a rank the saving run did not have keeps its state


_BIAS_SCRIPT = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from seektrain.parallel.process_group import init_distributed
    from seektrain.checkpoint.manager import CheckpointManager
    from seektrain.models import build_model, get_preset
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.tensor import DTensor

    init_distributed(60)
    mesh = init_device_mesh("cpu", (1,))
    def wrapped(kind):
        model = build_model(get_preset("tiny-v3"), seed=0)
        if kind == "fsdp":
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model
        return DistributedDataParallel(model, process_group=mesh.get_group())
    def biases(model):
        out = {}
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                out[name.removeprefix("module.")] = (b.full_tensor() if isinstance(b, DTensor) else b)
        return out
    for kind in ("ddp", "fsdp"):
        model = wrapped(kind)
        opt = torch.optim.AdamW(model.parameters())
        with torch.no_grad():
            for b in biases(model).values():
                b.copy_(torch.randn(b.shape))
        saved = {k: v.clone() for k, v in biases(model).items()}
        manager = CheckpointManager(Path(sys.argv[1]) / kind, keep=1, async_save=False, rank=0)
        manager.save(1, model, opt, {"step": 1})
        fresh = wrapped(kind)
        assert all(v.abs().sum() == 0 for v in biases(fresh).values())
        manager.load(manager.latest_valid(), fresh, torch.optim.AdamW(fresh.parameters()))
        got = biases(fresh)
        assert saved.keys() == got.keys() and len(saved) > 0
        assert all(torch.equal(saved[k], got[k]) for k in saved), kind
        print(kind, "ok", len(saved))
""")


def test_moe_balance_bias_is_saved_and_loaded_under_ddp_and_fsdp(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _BIAS_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ddp ok" in proc.stdout and "fsdp ok" in proc.stdout


def test_describe_error_is_one_line_for_multi_rank_failures():
    err = CheckpointException(
        "save failed",
        {
            0: (OSError(28, "No space left on device"), None),
            1: (OSError(28, "No space left on device"), None),
        },
    )
    assert describe_error(err) == "rank 0,1: OSError: [Errno 28] No space left on device"


def test_loss_guard_nan_spike_and_state():
    guard = LossGuard("skip", spike_factor=2.0)
    assert not guard.check(float("nan"), 1)
    for step, loss in enumerate([5.0, 4.8, 4.6, 4.5, 4.4], start=2):
        assert guard.check(loss, step)
    assert not guard.check(30.0, 7)  # > 2 × mean
    assert guard.check(4.3, 8) and guard.skipped == 2
    restored = LossGuard("skip", spike_factor=2.0)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.state_dict() == guard.state_dict()
    with pytest.raises(BadLossError, match=r"training stopped at step 9: loss is inf"):
        LossGuard("stop").check(float("inf"), 9)


def test_loss_guard_judges_on_the_device_and_keeps_the_last_window():
    """``judge`` returns tensors (the step masks its update with them) and keeps the recent good losses
    in a ring; the history it saves is the last SPIKE_WINDOW good losses, oldest first, as the list was."""
    from seektrain.train.loss_guard import SPIKE_WINDOW

    guard = LossGuard("skip", spike_factor=3.0)
    losses = [10.0 - 0.01 * i for i in range(SPIKE_WINDOW + 7)]
    for loss in losses:
        verdict = guard.judge(torch.tensor(loss, dtype=torch.float32))
        assert isinstance(verdict.good, torch.Tensor) and bool(verdict.good)
    expected = [float(torch.tensor(x, dtype=torch.float32)) for x in losses[-SPIKE_WINDOW:]]
    assert guard.history == expected
    verdict = guard.judge(torch.tensor(100.0))  # a spike: not good, and not added to the window
    assert not bool(verdict.good) and float(verdict.mean) == pytest.approx(sum(expected) / SPIKE_WINDOW)
    assert guard.history == expected and guard.skipped == 0  # counted when settled on the host
    guard.settle(60, 100.0, False, float(verdict.mean))
    assert guard.skipped == 1
    restored = LossGuard("skip", spike_factor=3.0)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.history == expected
    assert restored.check(9.0, 61) and restored.history == expected[1:] + [9.0]


def _thrown_by_torch_distributed(message: str) -> RuntimeError:
    """A RuntimeError as gloo throws one: from native code called by torch.distributed's Python code."""
    import os

    import torch.distributed as dist

    scope = {"torch": torch}
    where = os.path.join(os.path.dirname(dist.__file__), "distributed_c10d.py")
    exec(
        compile("def collective(msg):\n    torch._assert_async(torch.tensor(False), msg)\n", where, "exec"),
        scope,
    )
    try:
        scope["collective"](message)
    except RuntimeError as err:
        return err
    raise AssertionError("the native call did not throw")


def test_collective_failure_becomes_one_line_naming_rank_and_operation():
    """Told by type and origin: the same words thrown by other code are not a collective failure."""
    from seektrain.train.preemption import Preemption
    from seektrain.train.step_sync import StepSync

    preemption = Preemption(10.0, rank=1)
    sync = StepSync(preemption, torch.device("cpu"))
    text = (
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
    )
    try:
        sync.begin_step(7)

        def readable(err):
            return readable_failure(err, None, FailedAt(1, sync.step, preemption.phase, timeout_s=5.0))

        failure = readable(_thrown_by_torch_distributed(text))
        assert isinstance(failure, CollectiveError)
        message = str(failure)
        assert "\n" not in message and message.startswith("rank 1: a collective failed during step 7")
        assert (
            "Timed out waiting 5000ms for recv operation" in message
            and "dist.collective_timeout_s" in message
        )
        assert isinstance(
            readable(torch.distributed.DistBackendError("NCCL communicator was aborted")), CollectiveError
        )
        assert readable(RuntimeError(text)) is None  # the words alone, thrown elsewhere: left alone
        assert readable(RuntimeError("shape mismatch")) is None  # not a collective failure: left alone
    finally:
        preemption.close()


def test_new_config_keys_are_validated():
    cfg = load_config(
        None, ["train.on_bad_loss=stop", "train.spike_factor=3", "checkpoint.preempt_grace_s=5"]
    )
    assert cfg.train.on_bad_loss == "stop" and cfg.dist.collective_timeout_s == 600.0
    for bad in (
        "train.on_bad_loss=ignore",
        "train.spike_factor=0.5",
        "dist.collective_timeout_s=0",
        "checkpoint.preempt_grace_s=-1",
    ):
        with pytest.raises(ConfigError):
            load_config(None, [bad])


def test_hung_rank_ends_with_a_message_naming_rank_and_operation(tmp_path):
    """A real gloo timeout: rank 1 hangs at step 2, so rank 0's next collective times out after
    dist.collective_timeout_s and the run ends with one line naming the rank, the step and the wait."""
    proc = train(
        tmp_path,
        "train.steps=3",
        "dist.collective_timeout_s=5",
        "checkpoint.preempt_grace_s=2",
        nproc=2,
        env=hooks_env({"SEEKTRAIN_TEST_HANG": "2:1"}),
        check=False,
        timeout=240,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "seektrain: error: rank 0: a collective failed during step 2" in out
    assert "Timed out waiting 5000ms" in out


def test_killed_rank_ends_with_a_message_naming_rank_and_operation(tmp_path):
    """A real lost peer: rank 1 SIGKILLs itself at step 2 (no restart), so rank 0's next collective fails
    (gloo: a plain RuntimeError, told as a collective failure by where it was thrown) and the run ends
    with rank 0's one line naming the step, not an internal error."""
    proc = train(
        tmp_path,
        "train.steps=3",
        "checkpoint.preempt_grace_s=2",
        nproc=2,
        env=hooks_env({"SEEKTRAIN_TEST_KILL": "2:1"}),
        check=False,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "internal error" not in out, out[-3000:]
    assert "seektrain: error: rank 0: a collective failed during step 2" in out, out[-3000:]


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    """A failure between writing and renaming leaves the previous file and no temp file behind."""
    import os

    from seektrain.checkpoint.atomic import write_text_atomic

    target = write_text_atomic(tmp_path / "config.toml", "old\n")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_text_atomic(target, "new\n")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def _failing_writer(monkeypatch, error: BaseException, steps: set[int]):
    """DCP's writer raises ``error`` while writing the checkpoint of any step in ``steps``."""
    from seektrain.checkpoint import manager as manager_module
    from seektrain.checkpoint.storage import Writer

    class Failing(Writer):
        def write_data(self, plan, planner):
            if int(self.path.name[5:13]) in steps:
                raise error
            return super().write_data(plan, planner)

    monkeypatch.setattr(manager_module, "Writer", Failing)


def test_a_full_disk_says_so_also_when_torch_reports_unexpected_pos(tmp_path, monkeypatch):
    """A full disk shows in torch's zip writer as "unexpected pos", not as ENOSPC: the line says what it is."""
    model, optimizer = tiny()
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    _failing_writer(monkeypatch, error, {1})
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(tmp_path, keep=5, async_save=False, rank=0).save(1, model, optimizer, {"step": 1})
    assert "the disk holding run.dir is full" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_on_write_error_continue_skips_an_interval_save_and_retries(tmp_path, monkeypatch, async_save):
    import errno
    import os

    model, optimizer = tiny()
    _failing_writer(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), {2})
    manager = CheckpointManager(tmp_path, keep=5, async_save=async_save, rank=0, on_write_error="continue")
    for step in (1, 2, 3):
        manager.save(step, model, optimizer, {"step": step}, retry_later=True)
        manager.wait()
    assert manager.write_errors == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001", "step-00000003"]
    # the last save has no later chance: it stops the run even under continue
    _failing_writer(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), {4})
    with pytest.raises(CheckpointError, match="the disk holding run.dir is full"):
        manager.save(4, model, optimizer, {"step": 4})
        manager.wait()
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
