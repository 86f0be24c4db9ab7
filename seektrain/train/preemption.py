"""SIGTERM, from a worker's first line to its exit: what each moment of a run does with it.

Clusters stop jobs with SIGTERM (Slurm before a time limit or on preemption, Kubernetes on eviction,
torchrun forwarding its own), then SIGKILL a little later (torchrun: 30 s). The handler is installed
before anything else in the worker, so no moment falls back to Python's default (death without a word,
or worse, in the middle of a write). What it does depends on the moment:

* **Start-up** (process group, run-dir checks, resume choice, data, weights, model build, checkpoint
  load): nothing has been trained, so there is nothing to save. The handler raises ``Preempted`` at once,
  wherever the start-up is, and any error that follows from it (a peer that left a collective) is the
  same preemption. The few steps that move checkpoints around (``uninterrupted``) finish first. No
  checkpoint of an untrained model is written: the run dir is as it was, and it resumes as it would have.
* **Training**: the handler only sets a flag (a step must not be torn); the trainer's per-step
  all-reduce makes every rank stop at the same step, save it and exit (``step_sync.StepSync.end_step``).
* **A checkpoint being written**: the save goes on. A sync save is committed and, when every rank
  agrees (``agreed``) that a signal came, it is the preemption checkpoint: the run exits right after it.
  An async save still in flight is waited for and committed by the preemption save.
* **An evaluation**: abandoned between micro-batches once every rank agrees; the step it followed is
  saved (its ``val_loss`` is missing from ``metrics.jsonl``).

Whatever the moment, a watchdog ends the process ``checkpoint.preempt_grace_s`` after the signal
(a half-written checkpoint is a ``.tmp`` folder resume never loads and removes), and the run ends with
one line saying it was preempted and what run.dir holds, and exit status 143.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.checkpoint.finder import complete_checkpoints
from seektrain.errors import PREEMPTED
from seektrain.exit_codes import EXIT_PREEMPTED

log = logging.getLogger("seektrain.train")
PREEMPTED_PREFIX = PREEMPTED  # the one line's start (the launcher relays it, launch/worker_errors.py)


def print_line(line: str, code: int) -> int:
    print(line, file=sys.stderr)
    return code


ReportLine = Callable[[str, int], int]  # (line, exit code) -> exit code: how the watchdog's line is shown


class Preempted(SystemExit):
    """Leave the worker with status 143; ``line`` is the one line that says what run.dir holds."""

    def __init__(self, line: str):
        super().__init__(EXIT_PREEMPTED)
        self.line = line


def kept(run_dir: Path | None) -> str:
    """What a preempted run leaves to resume from: the newest complete checkpoint, or nothing."""
    found = complete_checkpoints(Path(run_dir) / "checkpoints") if run_dir is not None else []
    if not found:
        return "run.dir holds no checkpoint: the same command starts the run afresh"
    return f"run.dir resumes from {found[-1]}: run the same command again"


class Preemption:
    """The SIGTERM handler of one worker and what it knows: the moment (``phase``), whether a signal
    came (``received``), and the watchdog that bounds the time from the signal to the exit."""

    def __init__(self, grace_s: float, rank: int | None = None, report_line: ReportLine = print_line):
        """``report_line``: how the grace watchdog's one line reaches the user (the CLI passes its own,
        ``cli/errors.report_preempted``, which leaves a worker's line to its launcher; the trainer knows
        nothing of the CLI)."""
        self.grace_s = grace_s
        self.report_line = report_line
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.phase = "start-up"
        self.run_dir: Path | None = None  # known once the config is: for the line of what is kept
        self.received: int | None = None
        self._starting = True  # a signal now leaves at once
        self._deferred = 0  # depth of uninterrupted(): a signal waits for its end
        self._group = None  # a gloo group for agreed(); none of training's or the checkpoints'
        self._watchdog: threading.Timer | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    # ------------------------------------------------------------------ the handler
    def _on_signal(self, signum, _frame) -> None:
        if self.received is not None:
            return
        self.received = signum
        self._watchdog = threading.Timer(self.grace_s, self._grace_expired)
        self._watchdog.daemon = True
        self._watchdog.start()
        if self._starting and not self._deferred:
            raise self._leave_start_up()
        log.info(
            "rank %d received %s during %s: every rank stops at the same point and saves (grace %.0f s)",
            self.rank,
            signal.Signals(signum).name,
            self.phase,
            self.grace_s,
        )

    def _leave_start_up(self) -> Preempted:
        return Preempted(
            f"{PREEMPTED_PREFIX}: SIGTERM during start-up ({self.phase}): nothing was trained, so no "
            f"checkpoint was written; {kept(self.run_dir)}"
        )

    def _grace_expired(self) -> None:
        sys.stdout.flush()
        self.report_line(
            f"{PREEMPTED_PREFIX}: SIGTERM, and no checkpoint was written within "
            f"checkpoint.preempt_grace_s={self.grace_s:g} s (during {self.phase}); {kept(self.run_dir)}",
            EXIT_PREEMPTED,
        )
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)

    # ------------------------------------------------------------------ start-up
    @contextlib.contextmanager
    def start_up(self):
        """The worker's start-up: a signal leaves at once (``Preempted``), and so does any error after
        one, since it follows from it (a peer that left a collective). Afterwards a signal is a flag."""
        self._starting = True
        try:
            yield
        except Preempted:
            raise
        except BaseException:
            if self.received is None:
                raise
            raise self._leave_start_up() from None
        self._starting = False
        if self.received is not None:  # came during an uninterrupted() that ended the start-up
            raise self._leave_start_up()

    @contextlib.contextmanager
    def uninterrupted(self):
        """A few steps that must not be torn apart (moving checkpoints aside): a signal during them is
        acted on when they are done."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1
        if self._starting and not self._deferred and self.received is not None:
            raise self._leave_start_up()

    def open_group(self) -> None:
        """The gloo group ``agreed`` uses (collective: every rank calls it at the same point). Its own:
        an async save's thread runs collectives on the checkpoint group while ``agreed`` runs."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.grace_s))

    def agreed(self) -> bool:
        """Whether any rank has received the signal (collective over every rank, on the host: it never
        waits for the device). Used where the ranks already wait for each other: after an evaluation's
        micro-batch, after a sync save."""
        if self._group is None:
            return self.received is not None
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    # ------------------------------------------------------------------ the end
    def leave(self, what: str) -> Preempted:
        """The exit after the preemption checkpoint (every rank): ``what`` was saved."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        line = f"{PREEMPTED_PREFIX}: {what}; run the same command again to resume"
        log.info(line.removeprefix("seektrain: "))  # train.log; the CLI prints the line
        return Preempted(line)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
