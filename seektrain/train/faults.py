"""What training does when something goes wrong, so that no failure costs more than the steps since
the last checkpoint and every failure ends with one readable line.

* Preemption (SIGTERM, which torchrun forwards to its workers): ``preemption.py`` handles the signal at
  every moment of the run; during training its handler only sets a flag, and after each step the flags
  of all ranks are all-reduced (MAX) and read one step later (so the read never waits for the device),
  so every rank stops at the *same* step, saves a checkpoint of it and exits with status 143.
* Bad losses: the data-parallel mean loss of a step is judged on the device before the optimizer step.
  NaN/Inf, or more than ``train.spike_factor`` × the running mean of recent good losses, masks the
  update; at the next flush step (``seektrain.train.step_log``, always before a checkpoint) the host
  either reports the skip (``train.on_bad_loss = skip``: gradients dropped, counted as ``skipped`` in
  metrics) or stops the run with one line naming the step and the value (``stop``), saving nothing new.
  Every rank sees the same all-reduced loss, so every rank takes the same decision.
* Dead or hung ranks: collectives have a finite timeout (``dist.collective_timeout_s``); the backend's
  error (gloo's "Timed out waiting 600000ms for recv operation" or "Connection closed by peer") becomes
  a ``CollectiveError`` naming this rank, what it was doing and the peers it waits on, by node and
  address (a link between nodes that went down shows as such a timeout on every node;
  ``is_collective_failure`` tells such an error by its type and where it was thrown, not by its text),
  a ``RunFailure`` the CLI prints as one line. A killed worker is restarted by torchrun
  (``--max-restarts``) and the new workers resume from the last checkpoint.
* Out of memory in a step (CUDA's ``torch.OutOfMemoryError``, ``MemoryError``, a failed CPU allocation):
  one line naming the cheapest fix for this job (``out_of_memory.py``) instead of a traceback.
* The all-reduce after each step also tells every rank whether an async checkpoint has finished
  writing everywhere, so the trainer has the checkpoint manager commit it (make it visible to resume) as
  early as possible.
* Test-only fault hooks (``SEEKTRAIN_TEST_*``) are not here: ``fault_injection.py`` installs them at
  start-up when asked, so the training path holds no test code.
"""

from __future__ import annotations

import logging
import math
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from seektrain.errors import RunFailure
from seektrain.train.preemption import Preemption
from seektrain.train.transfer import HostCopy

log = logging.getLogger("seektrain.train")
SPIKE_WINDOW = 50  # good losses in the running mean
SPIKE_MIN_HISTORY = 5  # no spike verdict before this many good losses


class BadLossError(RunFailure):
    """The loss of a step was NaN/Inf or spiked and ``train.on_bad_loss = stop``."""


class CollectiveError(RunFailure):
    """A collective timed out or lost a peer; the message names the rank and the operation."""


@dataclass
class Verdict:
    """A step's bad-loss verdict, on the device: may the step update the model, and the running mean of
    recent good losses it was judged against (for the message)."""

    good: torch.Tensor  # bool
    mean: torch.Tensor  # float64


class LossGuard:
    """Decides whether a step's (global) loss may update the model.

    ``judge`` decides on the device without waiting for it: the recent good losses are a ring of
    ``SPIKE_WINDOW`` values there, and the verdict's ``good`` masks the update. ``settle``, called later
    with the values read on the host (at the next flush step, before anything is saved), counts and
    reports the bad step, or raises ``BadLossError`` under ``stop``. ``check`` does both for a loss
    already on the host.
    """

    def __init__(self, policy: str = "skip", spike_factor: float = 0.0, device: torch.device | str = "cpu"):
        self.policy, self.spike_factor = policy, spike_factor
        self.skipped = 0
        self._ring = torch.zeros(
            SPIKE_WINDOW, dtype=torch.float64, device=device
        )  # float64: as Python floats
        self._slots = torch.arange(SPIKE_WINDOW, device=device)
        self._count = torch.zeros((), dtype=torch.int64, device=device)  # good losses so far

    def judge(self, loss: torch.Tensor) -> Verdict:
        x = loss.detach().double()
        n = self._count.clamp(max=SPIKE_WINDOW)
        mean = self._ring.sum() / n.clamp(min=1)  # slots not yet written hold zeros
        good = torch.isfinite(x)
        if self.spike_factor > 0:
            good = good & ~((n >= SPIKE_MIN_HISTORY) & (x > self.spike_factor * mean))
        self._ring = torch.where(good & (self._slots == self._count % SPIKE_WINDOW), x, self._ring)
        self._count = self._count + good
        return Verdict(good, mean)

    def settle(self, step: int, loss: float, good: bool, mean: float) -> None:
        """The host's half of a verdict: nothing for a good loss; else a warning (skip) or the error (stop)."""
        if good:
            return
        if not math.isfinite(loss):
            problem = f"loss is {loss}"
        else:
            problem = (
                f"loss {loss:.6g} spiked above train.spike_factor={self.spike_factor:g} × running "
                f"mean {mean:.6g}"
            )
        if self.policy == "stop":
            raise BadLossError(
                f"training stopped at step {step}: {problem} (train.on_bad_loss=stop); no checkpoint "
                "was written for it. Resume from the last checkpoint, e.g. with a lower optim.lr, "
                "or set train.on_bad_loss=skip"
            )
        self.skipped += 1
        log.warning(
            "step %d: %s; update skipped (train.on_bad_loss=skip, %d skipped so far)",
            step,
            problem,
            self.skipped,
        )

    def check(self, loss: float, step: int) -> bool:
        verdict = self.judge(torch.tensor(loss, dtype=torch.float64, device=self._ring.device))
        good = bool(verdict.good)
        self.settle(step, loss, good, float(verdict.mean))
        return good

    @property
    def history(self) -> list[float]:
        """The recent good losses, oldest first (a host read)."""
        count, ring = int(self._count), self._ring.tolist()
        if count < SPIKE_WINDOW:
            return ring[:count]
        start = count % SPIKE_WINDOW
        return ring[start:] + ring[:start]

    def state_dict(self) -> dict:
        return {"history": self.history, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        history = [float(x) for x in state.get("history", [])][-SPIKE_WINDOW:]
        self._ring = torch.zeros_like(self._ring)
        self._ring[: len(history)] = torch.tensor(history, dtype=torch.float64)
        self._count = torch.full_like(self._count, len(history))
        self.skipped = int(state.get("skipped", 0))


class FaultGuard:
    """Per-step fault handling for the trainer: ``begin_step`` / ``end_step`` around every step,
    ``raise_readable`` for errors of the loop. SIGTERM is the ``preemption``'s (preemption.py), installed
    before the start-up; the guard carries its flag through the per-step all-reduce."""

    def __init__(
        self,
        train_cfg,
        ckpt_cfg,
        rank: int,
        device: torch.device,
        collective_timeout_s: float = 600.0,
        preemption: Preemption | None = None,
        facts: list[dict] | None = None,
    ):
        self.loss = LossGuard(train_cfg.on_bad_loss, train_cfg.spike_factor, device)
        self.rank, self.device = rank, device
        self.facts = (
            facts or []
        )  # every rank's host and address (dist_env.node_facts): who a collective waits on
        self._own_preemption = preemption is None  # a guard alone (tests) installs its own handler
        self.preemption = preemption or Preemption(ckpt_cfg.preempt_grace_s, rank)
        self.timeout_s = collective_timeout_s
        self.step: int | None = None
        self._in_transit: tuple[HostCopy, int | None] | None = None  # the last step's flags (several ranks)

    def close(self) -> None:
        """Hand SIGTERM back, when the guard installed its own handler (the trainer's is train()'s)."""
        if self._own_preemption:
            self.preemption.close()

    @property
    def phase(self) -> str:
        """What the run is doing, for the lines of a preemption or a failed collective."""
        return self.preemption.phase

    @phase.setter
    def phase(self, text: str) -> None:
        self.preemption.phase = text

    # ------------------------------------------------------------------ per step
    def begin_step(self, step: int) -> None:
        self.step = step
        self.phase = (
            f"step {step} (its FSDP all-gather/reduce-scatter, all-reduces, or the checkpoint after it)"
        )

    def end_step(
        self, step: int, writing: bool = False, pending: int | None = None
    ) -> tuple[bool, int | None]:
        """After every step: (any rank got SIGTERM, so every rank stops at this step; the async save
        ``pending`` once no rank is ``writing`` it any more, for the caller to commit, else None). Both
        ride on one all-reduce; the commit is the checkpoint manager's (``CheckpointManager.commit``).

        One process decides from its own flags. Several all-reduce them (MAX) on the device, and so that
        reading them never waits for the work queued after them, the flags all-reduced after step N are
        read after step N + 1 (their copy to the host was queued right behind the all-reduce): every rank
        still stops at the same step, one step after the signal was seen."""
        flags = [float(self.preemption.received is not None), float(writing)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.phase = f"the stop-flag all-reduce after step {step}"
            exchanged = self._exchange(flags, pending)
            if exchanged is None:
                return False, None
            flags, pending = exchanged
        written = pending if pending is not None and flags[1] == 0 else None
        if written is not None:
            self.phase = f"the commit of an async checkpoint after step {step}"
        return flags[0] > 0, written

    def _exchange(self, flags: list[float], pending: int | None) -> tuple[list[float], int | None] | None:
        """All-reduce this step's flags and return the previous step's (None after the first step)."""
        tensor = torch.empty(len(flags), device=self.device)
        for i, flag in enumerate(flags):
            tensor[i].fill_(flag)  # a fill on the device: a blocking copy from the host would wait for it
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        previous, self._in_transit = self._in_transit, (HostCopy(tensor), pending)
        if previous is None:
            return None
        return previous[0].values(), previous[1]

    # ------------------------------------------------------------------ errors
    def raise_readable(self, err: RuntimeError | MemoryError, plan=None) -> None:
        """Raise a one-line ``OutOfMemory`` naming the cheapest fix for ``plan`` (out_of_memory.py), or a
        one-line ``CollectiveError`` for a backend's collective failure; return otherwise."""
        from seektrain.train.out_of_memory import is_out_of_memory, out_of_memory_error

        if plan is not None and is_out_of_memory(err):
            where = f"step {self.step}" if self.step is not None else "start-up"
            raise out_of_memory_error(err, plan, self.rank, where) from None
        if not is_collective_failure(err):
            return
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        detail = detail.split("] ", 1)[-1] if detail.startswith("[") else detail
        detail = detail.split(". ", 1)[0].rstrip(".")  # gloo appends advice sentences; keep the fact
        raise CollectiveError(
            f"rank {self.rank}{where_text(self.facts, self.rank)}: a collective failed during {self.phase}: "
            f"{detail[:300]}. It waits on {peers_text(self.facts, self.rank)}: one of them died or is stuck "
            f"(see its log), or the network to its node is down; if it is only slow raise "
            f"dist.collective_timeout_s (now {self.timeout_s:g} s)"
        ) from None


def where_text(facts: list[dict], rank: int) -> str:
    """' on HOST (ADDR)' for ``rank`` under a multi-node launch (its advertised address), else ''."""
    if rank >= len(facts) or not facts[rank].get("addr"):
        return ""
    return f" on {facts[rank]['host']} ({facts[rank]['addr']})"


def peers_text(facts: list[dict], rank: int, most: int = 3) -> str:
    """The ranks a collective of ``rank`` may wait on, by node, other nodes first: 'rank 1 on vm
    (10.0.0.2)', 'ranks 8-15 on b (10.0.0.2), ranks 1-7 on this node'. A timeout does not say which peer
    stopped answering, so every other node is named (up to ``most``, then a count)."""
    if len(facts) < 2 or rank >= len(facts):
        return "the other ranks"
    nodes: dict[tuple, list[int]] = {}
    for r, f in enumerate(facts):
        if r != rank:
            nodes.setdefault((f.get("host", "?"), f.get("addr", "")), []).append(r)
    own = (facts[rank].get("host", "?"), facts[rank].get("addr", ""))
    parts = [
        f"{_ranks(rs)} on {host}" + (f" ({addr})" if addr else "")
        for (host, addr), rs in nodes.items()
        if (host, addr) != own
    ]
    if len(parts) > most:
        parts = parts[:most] + [f"{len(parts) - most} more nodes"]
    if own in nodes:
        parts.append(f"{_ranks(nodes[own])} on this node")
    return ", ".join(parts)


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1-7', 'ranks 1, 4' (consecutive runs joined)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a backend's failure of a collective, told by its type and origin, never by its
    wording (which differs between backends and releases): torch's ``DistError`` family (NCCL raises
    ``DistBackendError``; the CPU policy's own gloo collectives raise ``DistNetworkError``), or a plain
    ``RuntimeError`` thrown by the native call of a collective, which is how gloo reports a timeout or a
    lost peer: the innermost Python frame is torch.distributed's (``distributed_c10d``, FSDP's, DTensor's)."""
    if isinstance(err, dist.DistError):
        return True
    if type(err) is not RuntimeError:
        return False
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_TORCH_DISTRIBUTED)
