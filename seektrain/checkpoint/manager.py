"""Sharded checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout under ``run.dir/checkpoints/`` (docs/checkpoints.md has the full story)::

    step-00000100/            a complete checkpoint
        __R_0.distcp          DCP shards, one file per rank: model + optimizer state
        .metadata             DCP index (which rank holds which slice of which tensor)
        rng-rankRRRRR.cpu     per-rank RNG state, raw bytes (see rng.py)
        trainer_state.json    step, LR scheduler, loss scaler, data position, bad-loss history, config
        checksums.json        sha256 of every file, written after all ranks finished
        COMPLETE              written last: a checkpoint without it is never loaded
    step-00000200.tmp/        being written (async or interrupted): invisible to resume; its writer
                              holds an flock on .lock inside until it commits (write_lock.py)
    step-00000300.corrupt/    failed verification on resume; kept for inspection, never loaded

Why this shape: every rank writes its own shards into the ``.tmp`` folder; once DCP's write has
finished everywhere, rank 0 records checksums; after all ranks agree that their part succeeded, rank 0
writes the marker and renames the folder. A crash at any moment therefore leaves the previous set of
checkpoints or the new one, never a half one that looks whole. Every decision that could differ
between ranks (did the write succeed? which checkpoint is valid?) is taken once and shared through a
small collective on a dedicated gloo group, so ranks never disagree and never deadlock on a path one
of them considers broken. The dedicated group also lets async saves run their collectives in a
background thread without interleaving with training's.

Async saves (``checkpoint.async_save``, staging.py): ``save()`` copies the state into host buffers that
are reused across saves (pinned on a GPU) and returns; DCP's write and rank 0's checksums run on a
background thread; the commit (marker, rename, pruning) is left to the training thread at the end of a
step once every rank has finished. The time the training thread spends in ``save()`` and in the commit
is the checkpoint's *stall*, reported per step by ``take_stall_s()`` (``checkpoint_stall_s``).

A LoRA run (``adapters_only``) writes and reads only the adapters, their optimizer state and the
trainer state: its frozen base comes from where it always comes from (``model.hf_path`` or the preset's
seeded init), recorded and checked by lora_checkpoint.py.

Finding checkpoints is read-only and lives in finder.py (``seektrain sample`` and ``convert`` use it
too); this class alone changes a run dir, and only on rank 0: it removes a ``.tmp`` whose writer's lock
is free, moves corrupt checkpoints aside, and sets aside checkpoints that ``checkpoint.resume`` leaves
behind (resume.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from seektrain.checkpoint import rng, write_lock
from seektrain.checkpoint.finder import (
    CHECKSUMS,
    COMPLETE,
    TRAINER_STATE,
    complete_checkpoints,
    newest_valid,
    step_dir_name,
    tmp_folders,
)
from seektrain.checkpoint.resume import ResumeChoice, prepare_run_dir, resolve_resume
from seektrain.checkpoint.staging import run_in_background, snapshot_stager
from seektrain.checkpoint.storage import Writer, describe_error, fsync_dir, is_disk_full, sha256_file
from seektrain.errors import RunFailure, UserError
from seektrain.models.config import ModelConfig
from seektrain.models.lora import is_adapter

__all__ = ["COMPLETE", "CheckpointError", "CheckpointManager", "describe_error", "step_dir_name"]

log = logging.getLogger("seektrain.checkpoint")


class CheckpointError(RunFailure):
    """A checkpoint could not be written or read; the message names the path and the fix."""


@dataclass
class _Save:
    step: int
    tmp: Path
    final: Path
    state_json: str
    rng: dict[str, bytes]
    future: Future | None = None  # async save in flight
    lock: write_lock.WriteLock | None = None  # rank 0 holds the .tmp folder's write lock until commit
    retry_later: bool = False  # an interval save: under on_write_error=continue a failure is skipped
    save_s: float = 0.0  # the save() call on the training thread (async: the snapshot)
    started: float = 0.0  # when the write began


class CheckpointManager:
    def __init__(
        self,
        run_dir: Path,
        keep: int,
        async_save: bool,
        rank: int,
        timeout_s: float = 1800.0,
        pin_memory: bool = False,
        on_write_error: str = "stop",
        adapters_only: bool = False,
    ):
        """``pin_memory``: stage async saves in pinned host memory (the platform's ``pin_host_memory()``).
        ``on_write_error`` (``checkpoint.on_write_error``): ``continue`` skips a failed interval save.
        ``adapters_only``: a LoRA run, whose checkpoints hold the adapters and not the frozen base."""
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.async_save, self.rank = keep, async_save, rank
        self.on_write_error = on_write_error
        self.adapters_only = adapters_only
        self.pin_memory = pin_memory
        self._stager: Any = None  # created by the first async save, kept for the run: its buffers are reused
        self._pruning: Future | None = (
            None  # rank 0: the deletion of checkpoints beyond `keep`, in the background
        )
        self._pending: _Save | None = None
        self._depth = 0  # nesting of _blocking()
        self._stall: float | None = None  # seconds the caller was blocked since take_stall_s()
        self.last_step: int | None = None  # newest step saved or being saved by this manager
        self.write_errors = 0  # interval saves skipped under on_write_error=continue
        self.group = None
        if dist.is_initialized():  # collective: every rank constructs the manager at the same point
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def distributed(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def _worst(self, error: BaseException | None) -> int:
        """The worst outcome over the ranks: 0 every rank succeeded, 1 one failed, 2 one found its disk
        full, so that every rank's line says so and not only the rank whose write hit it."""
        code = 0 if error is None else 2 if is_disk_full(error) else 1
        if not self.distributed:
            return code
        flag = torch.tensor([code], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    # ------------------------------------------------------------------ discovery
    def _remove_stale_tmp(self) -> None:
        """Rank 0 at start: remove interrupted saves; a ``.tmp`` whose writer is alive is left alone."""
        for tmp in tmp_folders(self.root):
            if write_lock.remove_if_stale(tmp):
                log.info("removed %s, the leftover of an interrupted save", tmp)
            else:
                log.warning(
                    "left %s alone: another process (%s) is writing it; two jobs should not share a run.dir",
                    tmp,
                    write_lock.holder(tmp),
                )

    def _set_corrupt_aside(self, path: Path, problem: str) -> None:
        aside = path.with_name(path.name + ".corrupt")
        shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(path, aside)
        except OSError:
            aside = path
        log.warning(
            "checkpoint %s is unusable: %s; falling back to the previous one (kept as %s)",
            path.name,
            problem,
            aside.name,
        )

    def _choose(self) -> Path | None:
        """Rank 0's pick: newest verified checkpoint; corrupt ones are moved aside with a warning."""
        self._remove_stale_tmp()
        return newest_valid(self.root.parent, on_unusable=self._set_corrupt_aside)

    def latest_valid(self) -> Path | None:
        """Newest complete checkpoint whose checksums hold. Rank 0 alone reads and hashes the files
        and broadcasts its choice, so every rank resumes from the same step."""
        chosen = self._choose() if self.rank == 0 else None
        if not self.distributed:
            return chosen
        step = torch.tensor([-1 if chosen is None else int(chosen.name[5:])], dtype=torch.int64)
        dist.broadcast(step, src=0, group=self.group)
        return None if step.item() < 0 else self.root / step_dir_name(int(step.item()))

    def resume_choice(
        self, spec: str, configured: ModelConfig, uninterrupted=contextlib.nullcontext
    ) -> ResumeChoice:
        """What this run starts from under ``checkpoint.resume=spec`` (collective). Rank 0 tidies the
        run dir (interrupted saves, corrupt checkpoints), decides (``resolve_resume``), sets aside what
        the decision leaves behind (``prepare_run_dir``) and shares the outcome, so every rank loads the
        same checkpoint or raises the same one-line ValueError. ``uninterrupted()`` surrounds the moves
        of the setting aside (the trainer's: a SIGTERM then waits for them, ``train/preemption.py``)."""
        outcome: ResumeChoice | str | None = None
        if self.rank == 0:
            try:
                self._remove_stale_tmp()
                outcome = resolve_resume(
                    self.root.parent, spec, configured, on_unusable=self._set_corrupt_aside
                )
                with uninterrupted():
                    prepare_run_dir(self.root.parent, outcome)
            except ValueError as err:
                outcome = str(err)
            except OSError as err:  # the other ranks must hear of it too, or they wait for a broadcast
                outcome = (
                    f"cannot prepare {self.root.parent} for this run ({describe_error(err)}); check that "
                    "run.dir is writable"
                )
        if self.distributed:
            box = [outcome]
            dist.broadcast_object_list(box, src=0, group=self.group)
            outcome = box[0]
        if isinstance(outcome, str):
            raise UserError(outcome)
        assert outcome is not None  # rank 0 either chose or raised, and broadcast it
        return outcome

    # ------------------------------------------------------------------ save
    @contextlib.contextmanager
    def _blocking(self):
        """Count the time the caller spends inside (outermost use only) as checkpoint stall."""
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._stall = (self._stall or 0.0) + time.perf_counter() - t0

    def take_stall_s(self) -> float | None:
        """Seconds the caller's thread spent saving or committing checkpoints since the last call; None
        when it did neither."""
        stall, self._stall = self._stall, None
        return stall

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer,
        trainer_state: dict,
        blocking: bool = False,
        retry_later: bool = False,
    ) -> None:
        """Write a checkpoint of ``step`` (collective). With ``checkpoint.async_save`` it returns once the
        state is copied to host memory; ``wait`` (or the per-step check in ``train.step_sync``) commits it
        later. ``blocking`` forces a sync save; ``optimizer=None`` writes the model weights only.
        ``retry_later``: an interval save, which ``checkpoint.on_write_error=continue`` may skip when it
        fails (the final and the preemption saves have no later chance, so they always stop the run)."""
        with self._blocking():
            if self.last_step == step:  # e.g. an interval save and a preemption save of the same step
                self.wait()
                return
            self.wait()  # at most one save in flight
            try:
                self._save(step, model, optimizer, trainer_state, blocking, retry_later)
            except CheckpointError as err:
                self._skip_or_raise(err, retry_later)

    def _skip_or_raise(self, err: CheckpointError, retry_later: bool) -> None:
        """Every rank gets the same CheckpointError (the outcome is agreed first), so every rank skips or
        every rank stops; the failed save's ``.tmp`` is already removed by ``_fail``."""
        if not (retry_later and self.on_write_error == "continue"):
            raise err
        self.write_errors += 1
        if self.rank == 0:
            log.warning(
                "%s -- checkpoint.on_write_error=continue: training goes on, the next save is at the "
                "next checkpoint.interval",
                err,
            )

    def _save(
        self, step: int, model: nn.Module, optimizer, trainer_state: dict, blocking: bool, retry_later: bool
    ) -> None:
        t0 = time.perf_counter()
        final = self.root / step_dir_name(step)
        job = _Save(
            step,
            final.with_name(final.name + ".tmp"),
            final,
            json.dumps(trainer_state, indent=1),
            rng.capture() if optimizer is not None else {},
            retry_later=retry_later,
        )
        problem, fix = "", "check that run.dir is writable and has free space"
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if job.tmp.exists() and not write_lock.remove_if_stale(job.tmp):
                    problem = f"another process ({write_lock.holder(job.tmp)}) is writing it"
                    fix = "two jobs must not share a run.dir"
                    failure = RuntimeError(problem)
                else:
                    job.lock = write_lock.create_locked(job.tmp)
            except OSError as err:
                problem, failure = describe_error(err), err
        worst = self._worst(failure)
        if worst == 2:
            problem, fix = "the disk holding run.dir is full", "free space there (or lower checkpoint.keep)"
        if worst:
            raise CheckpointError(
                f"cannot create checkpoint folder {job.tmp}: {problem or 'failed on rank 0'}; {fix}"
            )
        self.last_step = step
        if optimizer is None:  # weights only (seektrain convert --to-checkpoint)
            state = {"model": self._saved_part(get_model_state_dict(model))}
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": self._saved_part(model_sd), "optim": optim_sd}
        background = self.async_save and not blocking
        error: BaseException | None = None
        try:  # the RNG files come first, so that rank 0 finds every rank's when it hashes the folder
            rng.write(job.tmp, self.rank, job.rng)
            if background:
                if self._stager is None:
                    self._stager = snapshot_stager(self.pin_memory)
                state = self._stager.stage(state)  # the snapshot: the only part training waits for
        except Exception as err:
            error = err
        worst = self._worst(error)  # before DCP's collectives, which a failed rank would not join
        if worst:
            self._fail(
                job, error or OSError("another rank could not write its RNG state or snapshot"), worst == 2
            )
        writer = Writer(job.tmp)
        job.started = time.perf_counter()
        if background:
            job.future = run_in_background(
                lambda: self._write(job, state, writer), "seektrain-checkpoint-write"
            )
            job.save_s = time.perf_counter() - t0
            self._pending = job
            return
        try:
            written = self._write(job, state, writer)
        except (Exception, CheckpointException) as err:
            error, written = err, time.perf_counter()
        job.save_s = time.perf_counter() - t0
        self._finish(job, error, written)

    def _write(self, job: _Save, state: dict, writer: Writer) -> float:
        """DCP's write (collective), then on rank 0 the trainer state and the checksums of every file: DCP
        has finished everywhere when it returns on rank 0, so all shards and RNG files are there. Runs on
        the background thread of an async save; returns when it ended (``time.perf_counter``)."""
        dcp.save(state, checkpoint_id=str(job.tmp), storage_writer=writer, process_group=self.group)
        if self.rank == 0:
            (job.tmp / TRAINER_STATE).write_text(job.state_json)
            sums = {
                p.name: sha256_file(p)
                for p in sorted(job.tmp.iterdir())
                if p.is_file() and p.name != write_lock.LOCK
            }
            (job.tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1))
        return time.perf_counter()

    def _saved_part(self, model_sd: dict) -> dict:
        """What a checkpoint holds of the model: all of it, or a LoRA run's adapters only."""
        return {k: v for k, v in model_sd.items() if is_adapter(k)} if self.adapters_only else model_sd

    def in_flight(self) -> bool:
        """An async save is still writing on this rank."""
        return (
            self._pending is not None and self._pending.future is not None and not self._pending.future.done()
        )

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def pending_step(self) -> int | None:
        """The step of the async save awaiting its commit, if any."""
        return self._pending.step if self._pending is not None else None

    def commit(self, step: int | None) -> None:
        """Commit the async save of ``step`` once every rank has written it (``StepSync.end_step`` says
        so), unless it was committed since; nothing for None."""
        if step is not None and self.pending_step == step:
            self.wait()

    def wait(self) -> None:
        """Finish the async save in flight, if any, and commit it (collective)."""
        job, self._pending = self._pending, None
        if job is None:
            return
        with self._blocking():
            error: BaseException | None = None
            written = time.perf_counter()
            try:
                assert job.future is not None  # a pending save is always an async one
                written = job.future.result()
            except (Exception, CheckpointException) as err:
                error = err
            try:
                self._finish(job, error, written)
            except CheckpointError as err:
                self._skip_or_raise(err, job.retry_later)

    def _finish(self, job: _Save, error: BaseException | None, written: float) -> None:
        """Every rank's part written (and hashed on rank 0)? Then commit, else fail on every rank."""
        worst = self._worst(error)
        if worst:
            self._fail(job, error or OSError("another rank could not write its part"), worst == 2)
        self._commit(job, written - job.started)

    def _fail(self, job: _Save, err: BaseException, disk_full: bool = False) -> None:
        self.last_step = None
        if self.rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
            if job.lock is not None:
                job.lock.release()
        if disk_full or is_disk_full(err):
            raise CheckpointError(
                f"writing checkpoint {job.tmp} failed: the disk holding run.dir is full ({describe_error(err)}); "
                f"earlier checkpoints in {self.root} are untouched. Free space there (or lower checkpoint.keep)"
            ) from None
        raise CheckpointError(
            f"writing checkpoint {job.tmp} failed ({describe_error(err)}); earlier checkpoints "
            f"in {self.root} are untouched. Free disk space or fix run.dir permissions"
        ) from None

    def _commit(self, job: _Save, written_s: float) -> None:
        t0 = time.perf_counter()
        problem, failure = "", None
        if self.rank == 0:
            try:
                (job.tmp / COMPLETE).write_text("ok\n")
                fsync_dir(job.tmp)
                if job.final.exists():
                    shutil.rmtree(job.final)
                os.replace(job.tmp, job.final)
                (job.final / write_lock.LOCK).unlink(missing_ok=True)
                fsync_dir(self.root)
            except OSError as err:
                problem, failure = describe_error(err), err
            if not problem and job.lock is not None:
                job.lock.release()
        worst = self._worst(failure if problem else None)
        if worst:
            self._fail(job, OSError(problem or "rank 0 could not commit"), worst == 2)
        if self.rank == 0:
            self._start_pruning()
            kind = "async" if job.future is not None else "sync"
            log.info(
                "checkpoint %s committed (%s): the training thread spent %.2f s in save() and %.2f s "
                "committing; written in %.2f s",
                job.final,
                kind,
                job.save_s,
                time.perf_counter() - t0,
                written_s,
            )

    def close(self) -> None:
        """Finish pruning and release the staging buffers (call after the last ``wait``); a write still
        running keeps its own buffers."""
        self._finish_pruning()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _start_pruning(self) -> None:
        """Delete all but the newest ``keep`` complete checkpoints on a background thread: removing
        gigabytes takes a noticeable time on many file systems (0.25 s for 1.5 GB here), and nothing
        waits for it. Only older complete checkpoints are touched, never a ``.tmp`` or the newest."""
        self._finish_pruning()
        self._pruning = run_in_background(self._prune, "seektrain-checkpoint-prune")

    def _finish_pruning(self) -> None:
        if self._pruning is not None:
            self._pruning.result()
            self._pruning = None

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model: nn.Module, optimizer) -> dict:
        """Load model (+ optimizer) shards into this rank's layout (DCP reshards as needed), this rank's
        RNG state, and return the trainer state. A weights-only checkpoint (``seektrain convert
        --to-checkpoint``) leaves the optimizer fresh."""
        trainer_state = json.loads((path / TRAINER_STATE).read_text())
        weights_only = bool(trainer_state.get("weights_only"))
        try:
            if weights_only:
                state: dict[str, Any] = {"model": get_model_state_dict(model)}
                dcp.load(state, checkpoint_id=str(path), process_group=self.group)
                set_model_state_dict(model, state["model"])
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": self._saved_part(model_sd), "optim": optim_sd}
                dcp.load(state, checkpoint_id=str(path), process_group=self.group)
                set_state_dict(
                    model,
                    optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                    options=StateDictOptions(strict=not self.adapters_only),
                )
        except (Exception, CheckpointException) as err:
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded into this model ({describe_error(err)}); "
                "was it written for a different model?"
            ) from None
        if not weights_only:
            rng.restore(path, self.rank)
        return trainer_state
