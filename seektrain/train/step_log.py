"""Steps waiting to be logged: their values stay on the device until a flush step reads them all.

A step leaves its numbers (loss, gradient norm, loss scale, expert imbalance, the bad-loss verdict) on
the device, so it never waits for the device to finish. The trainer flushes every ``run.log_interval``
steps, at the first and last step, and before anything depends on the values: an evaluation, a
checkpoint (so the loss guard has spoken before a step is saved), a preemption. A flush reads every
waiting value in one copy (one wait for the device), settles the loss guard's verdicts in step order (a
warning, or ``BadLossError`` under ``train.on_bad_loss=stop``, raised before the bad step is logged)
and hands each step, with the same values it would have had when read at once, to the monitor.
"""

from __future__ import annotations

import torch

from seektrain.observe.step_clock import Spans
from seektrain.train.faults import LossGuard
from seektrain.train.monitor import RunMonitor
from seektrain.train.step import StepRecord


class StepLog:
    def __init__(self, monitor: RunMonitor, loss_guard: LossGuard, device: torch.device, log_interval: int,
                 first_step: int, last_step: int):
        self.monitor, self.loss_guard, self.device = monitor, loss_guard, device
        self.log_interval, self.first_step, self.last_step = log_interval, first_step, last_step
        self.waiting: list[tuple[int, StepRecord]] = []

    def add(self, step: int, record: StepRecord) -> None:
        self.waiting.append((step, record))

    def due(self, step: int) -> bool:
        """A flush step by the clock: every ``run.log_interval``-th, the first and the last."""
        return step % self.log_interval == 0 or step in (self.first_step, self.last_step)

    def flush(self) -> None:
        waiting, self.waiting = self.waiting, []
        tensors = [t for _, record in waiting for t in _device_values(record)]
        read = iter(torch.stack([t.detach().to(self.device, torch.float64).reshape(()) for t in tensors]).tolist()
                    if tensors else [])
        for step, record in waiting:
            values = {}
            for key, value in record.values.items():
                if isinstance(value, torch.Tensor):
                    number = next(read)
                    value = number if value.is_floating_point() else int(number)
                elif isinstance(value, Spans):
                    value = value.seconds()
                values[key] = value
            good, mean = bool(next(read)), next(read)
            self.loss_guard.settle(step, values["loss"], good, mean)
            self.monitor.log(step, values)


def _device_values(record: StepRecord) -> list[torch.Tensor]:
    """The record's tensors in the order ``flush`` consumes them: its values', then the verdict's."""
    return [v for v in record.values.values() if isinstance(v, torch.Tensor)] + [record.verdict.good,
                                                                                 record.verdict.mean]
