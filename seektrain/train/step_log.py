"""Steps waiting to be logged: their values stay on the device until a flush step reads them all.

A step leaves its numbers (loss, gradient norm, loss scale, expert imbalance and the per-layer MoE
table, the bad-loss verdict) on the device, so it never waits for the device to finish. The trainer
flushes every ``run.log_interval`` steps, at the first and last step, and after an evaluation, a
checkpoint or a preemption. Before a
checkpoint is saved it settles: it reads every waiting value in one copy (one wait for the device) and
settles the loss guard's verdicts in step order (a warning, or ``BadLossError`` under
``train.on_bad_loss=stop``, raised before the bad step is logged or saved). A flush settles and hands
each step, with the same values it would have had when read at once, to the monitor. When an error
ends the loop, the steps completed before it are still logged (``salvage``), as before.
"""

from __future__ import annotations

import torch

from seektrain.observe.step_clock import Spans
from seektrain.train.balance import layer_metrics
from seektrain.train.collective_failure import is_collective_failure
from seektrain.train.loss_guard import BadLossError, LossGuard
from seektrain.train.monitor import RunMonitor
from seektrain.train.step import StepRecord


class StepLog:
    def __init__(
        self,
        monitor: RunMonitor,
        loss_guard: LossGuard,
        device: torch.device,
        log_interval: int,
        first_step: int,
        last_step: int,
    ):
        self.monitor, self.loss_guard, self.device = monitor, loss_guard, device
        self.log_interval, self.first_step, self.last_step = log_interval, first_step, last_step
        self.waiting: list[tuple[int, StepRecord]] = []

    def add(self, step: int, record: StepRecord) -> None:
        self.waiting.append((step, record))

    def due(self, step: int) -> bool:
        """A flush step by the clock: every ``run.log_interval``-th, the first and the last."""
        return step % self.log_interval == 0 or step in (self.first_step, self.last_step)

    def settle(self) -> None:
        """Read the waiting steps' device values (one copy) and settle their loss verdicts in step order;
        a ``BadLossError`` (``stop``) is raised after the steps before the bad one are logged."""
        unread = [(step, record) for step, record in self.waiting if not record.read]
        tensors = [t for _, record in unread for t in _device_values(record)]
        numbers = iter(
            torch.cat([t.detach().to(self.device, torch.float64).reshape(-1) for t in tensors]).tolist()
            if tensors
            else []
        )
        for step, record in unread:
            for key, value in record.values.items():
                if isinstance(value, torch.Tensor) and value.dim():  # a table: a flat list of numbers
                    record.values[key] = [next(numbers) for _ in range(value.numel())]
                elif isinstance(value, torch.Tensor):
                    number = next(numbers)
                    record.values[key] = number if value.is_floating_point() else int(number)
            good, mean = bool(next(numbers)), next(numbers)
            record.read = True
            try:
                self.loss_guard.settle(step, record.values["loss"], good, mean)
            except BadLossError:
                self._log([(s, r) for s, r in self.waiting if s < step])
                raise

    def flush(self) -> None:
        """Settle, then hand every waiting step's metrics to the monitor."""
        self.settle()
        waiting, self.waiting = self.waiting, []
        self._log(waiting)

    def salvage(self, err: BaseException) -> None:
        """After ``err`` ended the loop: log the steps that completed before it, as reading them at once
        would have, unless the error may leave the device unable to answer (a failed collective: a read
        could wait behind it) or is the loss guard's own. Never raises: ``err`` is what the user sees."""
        if isinstance(err, BadLossError) or is_collective_failure(err):
            return
        try:
            self.flush()
        except Exception:
            pass

    def _log(self, steps: list[tuple[int, StepRecord]]) -> None:
        for step, record in steps:
            values = {k: v.seconds() if isinstance(v, Spans) else v for k, v in record.values.items()}
            table = values.pop("moe_layers", None)  # the per-layer MoE health, as its metric keys
            if isinstance(table, list):
                values.update(layer_metrics(table))
            self.monitor.log(step, values)


def _device_values(record: StepRecord) -> list[torch.Tensor]:
    """The record's tensors in the order ``settle`` consumes them: its values', then the verdict's."""
    return [v for v in record.values.values() if isinstance(v, torch.Tensor)] + [
        record.verdict.good,
        record.verdict.mean,
    ]
