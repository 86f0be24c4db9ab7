"""What training does when something goes wrong, so that no failure costs more than the steps since
the last checkpoint and every failure ends with one readable line.

* Preemption (SIGTERM, which torchrun forwards to its workers): the signal handler only sets a flag;
  after each step the flags of all ranks are all-reduced (MAX), so every rank stops at the *same* step,
  saves a checkpoint of it and exits with status 143. A watchdog ends the process if that takes longer
  than ``checkpoint.preempt_grace_s`` (torchrun sends SIGKILL 30 s after SIGTERM; a half-written
  checkpoint is invisible anyway).
* Bad losses: the data-parallel mean loss of a step is checked before the optimizer step. NaN/Inf, or
  more than ``train.spike_factor`` × the running mean of recent good losses, either skips the update
  (``train.on_bad_loss = skip``: gradients dropped, counted as ``skipped`` in metrics) or stops the run
  with one line naming the step and the value (``stop``), saving nothing new. Every rank sees the same
  all-reduced loss, so every rank takes the same decision.
* Dead or hung ranks: collectives have a finite timeout (``dist.collective_timeout_s``); the backend's
  error (gloo's "Timed out waiting 600000ms for recv operation" or "Connection closed by peer") becomes
  a ``CollectiveError`` naming this rank and what it was doing. It subclasses ``ConnectionError`` (an
  ``OSError``), so the CLI prints it as one line. A killed worker is restarted by torchrun
  (``--max-restarts``) and the new workers resume from the last checkpoint.
* Out of memory in a step (CUDA's ``torch.OutOfMemoryError``, ``MemoryError``, a failed CPU allocation):
  one line naming the cheapest fix for this job (``out_of_memory.py``) instead of a traceback.
* The all-reduce after each step also tells every rank whether an async checkpoint has finished
  writing everywhere, so it is committed (made visible to resume) as early as possible.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from seektrain.checkpoint import hooks

log = logging.getLogger("seektrain.train")
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM
SPIKE_WINDOW = 50  # good losses in the running mean
SPIKE_MIN_HISTORY = 5  # no spike verdict before this many good losses


class BadLossError(ValueError):
    """The loss of a step was NaN/Inf or spiked and ``train.on_bad_loss = stop``."""


class CollectiveError(ConnectionError):
    """A collective timed out or lost a peer; the message names the rank and the operation."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def inject_nan(loss: torch.Tensor, step: int) -> torch.Tensor:
    """Test hook ``SEEKTRAIN_TEST_NAN=STEP[:RANK]``: this step's loss becomes NaN before backward."""
    if hooks.fires("NAN", step, _rank()):
        return loss * float("nan")
    return loss


class LossGuard:
    """Decides whether a step's (global) loss may update the model."""

    def __init__(self, policy: str = "skip", spike_factor: float = 0.0):
        self.policy, self.spike_factor = policy, spike_factor
        self.history: list[float] = []
        self.skipped = 0

    def check(self, loss: float, step: int) -> bool:
        problem = None
        if not math.isfinite(loss):
            problem = f"loss is {loss}"
        elif self.spike_factor > 0 and len(self.history) >= SPIKE_MIN_HISTORY:
            mean = sum(self.history) / len(self.history)
            if loss > self.spike_factor * mean:
                problem = (f"loss {loss:.6g} spiked above train.spike_factor={self.spike_factor:g} × running "
                           f"mean {mean:.6g}")
        if problem is None:
            self.history = (self.history + [loss])[-SPIKE_WINDOW:]
            return True
        if self.policy == "stop":
            raise BadLossError(f"training stopped at step {step}: {problem} (train.on_bad_loss=stop); no checkpoint "
                               "was written for it. Resume from the last checkpoint, e.g. with a lower optim.lr, "
                               "or set train.on_bad_loss=skip")
        self.skipped += 1
        log.warning("step %d: %s; update skipped (train.on_bad_loss=skip, %d skipped so far)", step, problem,
                    self.skipped)
        return False

    def state_dict(self) -> dict:
        return {"history": list(self.history), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(x) for x in state.get("history", [])]
        self.skipped = int(state.get("skipped", 0))


class FaultGuard:
    """Per-step fault handling for the trainer: ``begin_step`` / ``end_step`` around every step,
    ``raise_readable`` for errors of the loop, ``exit_preempted`` after the preemption checkpoint."""

    def __init__(self, train_cfg, ckpt_cfg, ckpt, rank: int, device: torch.device,
                 collective_timeout_s: float = 600.0):
        self.loss = LossGuard(train_cfg.on_bad_loss, train_cfg.spike_factor)
        self.ckpt, self.rank, self.device = ckpt, rank, device
        self.grace_s = ckpt_cfg.preempt_grace_s
        self.timeout_s = collective_timeout_s
        self.phase = "start-up"
        self.step: int | None = None
        self.signal_received: int | None = None
        self._watchdog: threading.Timer | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    # ------------------------------------------------------------------ preemption
    def _on_signal(self, signum, _frame) -> None:
        if self.signal_received is not None:
            return
        self.signal_received = signum
        log.warning("rank %d received %s during %s: saving a checkpoint after this step (grace %.0f s)",
                    self.rank, signal.Signals(signum).name, self.phase, self.grace_s)
        self._watchdog = threading.Timer(self.grace_s, self._grace_expired)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _grace_expired(self) -> None:
        sys.stderr.write(f"seektrain: error: rank {self.rank}: no checkpoint within checkpoint.preempt_grace_s="
                         f"{self.grace_s:g} s after SIGTERM (during {self.phase}); exiting, the previous "
                         "checkpoint stays valid\n")
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT_CODE)

    def exit_preempted(self, step: int, path) -> None:
        """Called on every rank once the preemption checkpoint is committed: exit with status 143."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        log.warning("preempted: stopped after step %d and saved %s; run the same command again to resume",
                    step, path)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    # ------------------------------------------------------------------ per step
    def begin_step(self, step: int) -> None:
        self.step = step
        self.phase = f"step {step} (its FSDP all-gather/reduce-scatter, all-reduces, or the checkpoint after it)"
        if hooks.fires("OOM", step, self.rank):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (test hook "
                                         f"SEEKTRAIN_TEST_OOM at step {step})")
        if hooks.fires("KILL", step, self.rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if hooks.fires("HANG", step, self.rank):
            time.sleep(3600)

    def end_step(self, step: int) -> bool:
        """Collective after every step. True when any rank got SIGTERM (then all ranks stop here).
        Also commits an async checkpoint once every rank has finished writing it."""
        flags = torch.tensor([float(self.signal_received is not None), float(self.ckpt.in_flight())],
                             device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.phase = f"the stop-flag all-reduce after step {step}"
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.tolist()
        if self.ckpt.pending and flags[1] == 0:
            self.phase = f"the commit of an async checkpoint after step {step}"
            self.ckpt.wait()
        return flags[0] > 0

    # ------------------------------------------------------------------ errors
    def raise_readable(self, err: RuntimeError | MemoryError, plan=None) -> None:
        """Raise a one-line ``OutOfMemory`` naming the cheapest fix for ``plan`` (out_of_memory.py), or a
        one-line ``CollectiveError`` for a backend's collective failure; return otherwise."""
        from seektrain.checkpoint.manager import CheckpointError
        from seektrain.train.out_of_memory import is_out_of_memory, out_of_memory_error

        if plan is not None and is_out_of_memory(err):
            where = f"step {self.step}" if self.step is not None else "start-up"
            raise out_of_memory_error(err, plan, self.rank, where) from None
        if isinstance(err, CheckpointError) or not is_collective_failure(err):
            return
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        detail = detail.split("] ", 1)[-1] if detail.startswith("[") else detail
        detail = detail.split(". ", 1)[0].rstrip(".")  # gloo appends advice sentences; keep the fact
        raise CollectiveError(
            f"rank {self.rank}: a collective failed during {self.phase}: {detail[:300]}. Another rank died "
            f"or is stuck (see its log); if it is only slow raise dist.collective_timeout_s "
            f"(now {self.timeout_s:g} s)") from None


def is_collective_failure(err: BaseException) -> bool:
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return any(s in text for s in ("Timed out waiting", "timed out", "Connection closed by peer",
                                   "Connection reset by peer", "ProcessGroupGloo", "ProcessGroupNCCL",
                                   "NCCL error", "gloo"))
