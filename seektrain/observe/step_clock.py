"""Timing the phases of a step without waiting for the device.

On a CPU the work is done when the call returns, so a mark is the host clock. On an accelerator the
host only queues work: a mark is then an event recorded on the current stream, and a span lasts the
device's own time between its two marks, read once the device has passed them (at a flush step). A
phase thus measures the device's time, including any time it sat idle waiting for the host (data, a
slow Python step), and not the host's time spent queueing work it does not wait for.
"""

from __future__ import annotations

import time

import torch

Mark = float | torch.Event


class StepClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.events = device.type != "cpu"  # the CPU backend has no events (and needs none)

    def mark(self) -> Mark:
        if not self.events:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event


class Spans(list):
    """(start, end) marks of one phase within a step; ``seconds()`` is their total length (for events,
    call it once the device has passed the last mark: it waits for it)."""

    def seconds(self) -> float:
        total = 0.0
        for start, end in self:
            if isinstance(start, float):
                total += end - start
            else:
                end.synchronize()
                total += start.elapsed_time(end) / 1000.0  # milliseconds
        return total
