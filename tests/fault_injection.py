"""Test-only fault injection, loaded into a training process through the trainer's hook point
(``seektrain/train/run_hooks.py``: ``SEEKTRAIN_TEST_HOOKS`` names this file) and installed at start-up
only for the ``SEEKTRAIN_TEST_*`` variables that are set.

Why it exists: the failure paths (a rank killed mid-run, a full disk, a NaN loss, a hung rank) are the ones
that matter most and are the hardest to reach on purpose from outside the process, and the tests reach
them through a real ``seektrain train`` subprocess, where only the environment gets in. Why installed,
not checked: the hooks wrap the few functions involved, once, and only for the variables that are set, so
the training path holds no test code and a normal run executes none of this. ``hooks_env`` gives a
test's subprocess the variables plus ``SEEKTRAIN_TEST_HOOKS`` (workers inherit it; a file path needs
nothing on PYTHONPATH, so a fresh clone's ``make test`` finds it).

Each hook is one variable ``SEEKTRAIN_TEST_<NAME>=STEP[:RANK]``: it fires at optimizer step ``STEP`` on
rank ``RANK`` (every rank when omitted) and on the first attempt of an elastic job only
(``TORCHELASTIC_RESTART_COUNT`` is 0 or unset), so a restarted job can finish.

    KILL         the rank sends itself SIGKILL at the start of the step (a crashed worker)
    HANG         the rank sleeps for an hour at the start of the step (a hung worker)
    OOM          the step raises torch.OutOfMemoryError at its start (a step that does not fit)
    NAN          the loss of the step becomes NaN before backward (a diverged step)
    CKPT_ENOSPC  writing the checkpoint of the step raises OSError(ENOSPC) (a full disk)
    SIGTERM_SAVE while the checkpoint of the step is being written: a sync save's signal lands in DCP's
                 write on the training thread; an async save's once ``save()`` has returned and its
                 write, held back for a second, is still in flight on its thread
    SIGTERM_EVAL during the evaluation after the step (in its first micro-batch)

A SIGTERM hook sends the signal as a cluster does: to the launcher, which forwards it to every worker
(torchrun does), or to the process itself when there is no launcher; then it waits until this worker's
handler has run, so the signal lands inside the moment named. Name one rank (``STEP:0``): a launcher
sent SIGTERM twice is not what clusters do.

Two hooks act at start-up, before any step, so they name a rank only, or a moment (``install_startup_hooks``):

    UNSHARED_RUN_DIR=RANK  that rank reads the shared-storage marker from a folder of its own, as a
                           node whose run.dir is a local disk would (checkpoint/shared_dir.py)
    SIGTERM_STARTUP=MOMENT[:RANK]  SIGTERM at the start of a start-up moment: ``init`` (the process
                           group), ``data`` (opening the data, its manifest check), ``model`` (building
                           the model), ``resume`` (loading the checkpoint)

One hook damages the data while the run reads it (``install_data_hooks``), counted in global batches:

    DATA_DAMAGE=BATCH[:RANK]  just before that rank's training loader reads global batch BATCH (1 = the
                              first of the run), it flips one byte of the token shard under the first
                              window of its share, and says which on stderr (a shard that goes bad
                              mid-run: data/blocks.py must stop every rank before a step uses it)
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import threading
import time
from pathlib import Path

import torch

from seektrain.train.run_hooks import HOOKS_ENV

PREFIX = "SEEKTRAIN_TEST_"
HOOKS = ("KILL", "HANG", "OOM", "NAN", "CKPT_ENOSPC", "SIGTERM_SAVE", "SIGTERM_EVAL")
WAIT_FOR_HANDLER_S = 30.0
ASYNC_WRITE_HELD_S = 1.0  # SIGTERM_SAVE holds an async write this long, so it is in flight at the stop


def hooks_env(faults: dict[str, str]) -> dict[str, str]:
    """The environment entries a test's ``seektrain train`` needs for ``faults`` (``SEEKTRAIN_TEST_*``
    variables and their values): those, and this file as the trainer's hook module."""
    return {HOOKS_ENV: str(Path(__file__).resolve()), **faults}


def at_startup(rank: int, preemption) -> None:
    """The trainer's first hook (run_hooks.py): the start-up hooks."""
    install_startup_hooks(rank, preemption)


def at_data(rank: int) -> None:
    """The trainer's hook before the data is opened: the data hooks."""
    install_data_hooks(rank)


def at_steps(sync, rank: int) -> None:
    """The trainer's hook before the model is built: the step hooks."""
    install_from_env(sync, rank)


def _wanted(name: str, rank: int) -> int | None:
    """The step hook ``name`` fires at on ``rank`` in this attempt, or None."""
    value = os.environ.get(PREFIX + name)
    if not value or not _first_attempt():
        return None
    step, _, want_rank = value.partition(":")
    return int(step) if not want_rank or int(want_rank) == rank else None


def _sigterm(preemption) -> None:
    """SIGTERM to the launcher (it forwards it to every worker) or, without one, to this process; then
    wait until ``preemption``'s handler has run here (during start-up it raises, ending the wait)."""
    os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + WAIT_FOR_HANDLER_S
    while preemption.received is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


def install_startup_hooks(rank: int, preemption) -> list[str]:
    """The start-up hooks whose variables are set for this ``rank`` (empty on a normal run); installed
    before the process group exists (``rank`` is torchrun's ``RANK``). ``preemption``: the worker's
    SIGTERM handler (train/preemption.py)."""
    installed = []
    moment, _, want_rank = os.environ.get(PREFIX + "SIGTERM_STARTUP", "").partition(":")
    if moment and _first_attempt() and (not want_rank or int(want_rank) == rank):
        _sigterm_at_startup(moment, preemption)
        installed.append("SIGTERM_STARTUP")
    value = os.environ.get(PREFIX + "UNSHARED_RUN_DIR")
    if not value or int(value) != rank:
        return installed
    from seektrain.checkpoint import shared_dir

    read_marker = shared_dir.read_marker

    def read_elsewhere(path: Path) -> str | None:  # this "node" has its own, empty, folder
        local = path.parent.with_name(f"{path.parent.name}.node-local-rank{rank}")
        local.mkdir(parents=True, exist_ok=True)
        return read_marker(local / path.name)

    shared_dir.read_marker = read_elsewhere
    return [*installed, "UNSHARED_RUN_DIR"]


def _sigterm_at_startup(moment: str, preemption) -> None:
    """Wrap the start-up function of ``moment`` so that SIGTERM arrives as it starts."""
    from seektrain.checkpoint.manager import CheckpointManager
    from seektrain.train import startup, trainer

    owners = {
        "init": (trainer, "init_distributed"),
        "data": (startup, "open_training_data"),
        "model": (startup, "build_step_context"),
        "resume": (CheckpointManager, "load"),
    }
    if moment not in owners:
        raise ValueError(f"{PREFIX}SIGTERM_STARTUP={moment}: use one of {', '.join(owners)}")
    owner, name = owners[moment]
    real = getattr(owner, name)

    @functools.wraps(real)
    def signalled(*args, **kwargs):
        _sigterm(preemption)
        return real(*args, **kwargs)

    setattr(owner, name, signalled)


def install_from_env(sync, rank: int) -> list[str]:
    """Install the hooks whose variables are set, for this ``rank``; ``sync`` (the run's ``StepSync``)
    tells which step is running. Returns the names installed (empty on a normal run: nothing changes)."""
    steps = {name: step for name in HOOKS if (step := _wanted(name, rank)) is not None}
    if not steps:
        return []
    from seektrain.checkpoint import manager, storage
    from seektrain.train import step as step_module

    def at(name: str) -> bool:
        return steps.get(name) == sync.step

    sent: list[int] = []  # a SIGTERM hook fires once

    if {"KILL", "HANG", "OOM"} & steps.keys():
        begin_step = sync.begin_step

        def begin_with_faults(step: int) -> None:
            begin_step(step)
            if at("OOM"):
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate 20.00 GiB (test hook "
                    f"SEEKTRAIN_TEST_OOM at step {step})"
                )
            if at("KILL"):
                os.kill(os.getpid(), signal.SIGKILL)
            if at("HANG"):
                time.sleep(3600)

        sync.begin_step = begin_with_faults
    if "NAN" in steps:
        model_loss = step_module.model_loss

        @functools.wraps(model_loss)
        def nan_loss(*args, **kwargs):
            loss, parts = model_loss(*args, **kwargs)
            return (loss * float("nan") if at("NAN") else loss), parts

        step_module.model_loss = nan_loss
    if {"CKPT_ENOSPC", "SIGTERM_SAVE"} & steps.keys():

        class FaultyDisk(storage.Writer):
            def write_data(self, plan, planner):
                step = int(Path(self.path).name.removeprefix("step-")[:8])  # the .tmp folder's step
                if steps.get("CKPT_ENOSPC") == step:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                if steps.get("SIGTERM_SAVE") == step and not sent:
                    if threading.current_thread() is threading.main_thread():
                        sent.append(step)  # a sync save: the signal lands in its write
                        _sigterm(sync.preemption)
                    else:  # an async save: still writing when the signal comes, and a while after
                        time.sleep(ASYNC_WRITE_HELD_S)
                return super().write_data(plan, planner)

        manager.Writer = FaultyDisk
    if "SIGTERM_SAVE" in steps:
        save = manager.CheckpointManager.save

        @functools.wraps(save)
        def save_in_flight(self, step, *args, **kwargs):
            save(self, step, *args, **kwargs)
            if steps["SIGTERM_SAVE"] == step and self.in_flight() and not sent:
                sent.append(step)  # the async write of the step has begun on its thread
                _sigterm(sync.preemption)

        manager.CheckpointManager.save = save_in_flight
    if "SIGTERM_EVAL" in steps:
        from seektrain.train import evaluate

        eval_loss = evaluate.model_loss

        @functools.wraps(eval_loss)
        def signalled_eval_loss(*args, **kwargs):
            if at("SIGTERM_EVAL") and not sent:
                sent.append(sync.step)
                _sigterm(sync.preemption)
            return eval_loss(*args, **kwargs)

        evaluate.model_loss = signalled_eval_loss
    return sorted(steps)


def install_data_hooks(rank: int) -> list[str]:
    """The data hooks whose variables are set for this ``rank`` (empty on a normal run)."""
    batch = _wanted("DATA_DAMAGE", rank)
    if batch is None:
        return []
    import sys

    import numpy as np

    from seektrain.data.batch_loader import DistributedBatchLoader

    read_batch = DistributedBatchLoader.__next__

    def damage_then_read(loader: DistributedBatchLoader):
        if loader.dataset.split == "train" and loader.consumed_windows // loader.global_batch + 1 == batch:
            epoch, offset = loader.epoch, loader.offset
            if offset + loader.global_batch > loader.num_windows:  # the loader's epoch roll-over
                epoch, offset = epoch + 1, 0
            unit = int(
                np.random.default_rng([loader.seed, epoch]).permutation(loader.num_windows)[
                    offset + loader.dp_rank
                ]
            )
            start = unit * loader.seq_len if loader._rows is None else int(loader._rows[unit][0])
            ds, first = loader.dataset, 0
            for shard in ds.shards:  # the shard holding token `start`, and where it begins
                if first + shard.tokens > start:
                    break
                first += shard.tokens
            byte = (start - first) * ds.dtype.itemsize
            with open(ds.directory / shard.file, "r+b") as f:
                f.seek(byte)
                old = f.read(1)[0]
                f.seek(byte)
                f.write(bytes([old ^ 0xFF]))
            block = (start - first) // (ds.manifest.block_tokens or 1)
            sys.stderr.write(
                f"SEEKTRAIN_TEST_DATA_DAMAGE: rank {rank} flipped byte {byte} of {shard.file} (block {block})\n"
            )
        return read_batch(loader)

    DistributedBatchLoader.__next__ = damage_then_read  # type: ignore[method-assign,assignment]
    return ["DATA_DAMAGE"]
