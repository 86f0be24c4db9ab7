"""The bad-loss guard: a step whose data-parallel mean loss is NaN/Inf, or more than
``train.spike_factor`` × the running mean of recent good losses, must not update the model.

Why on the device: reading the loss on the host every step would wait for the device every step. The
verdict is a tensor that masks the update; the host reads it at the next flush step
(``seektrain.train.step_log``, always before a checkpoint) and either reports the skip
(``train.on_bad_loss = skip``: gradients dropped, counted as ``skipped`` in metrics) or stops the run
with one line naming the step and the value (``stop``), saving nothing new. Every rank sees the same
all-reduced loss, so every rank takes the same decision.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from seektrain.errors import RunFailure

log = logging.getLogger("seektrain.train")
SPIKE_WINDOW = 50  # good losses in the running mean
SPIKE_MIN_HISTORY = 5  # no spike verdict before this many good losses


class BadLossError(RunFailure):
    """The loss of a step was NaN/Inf or spiked and ``train.on_bad_loss = stop``."""


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
