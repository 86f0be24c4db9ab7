"""Where a training step's time goes: data wait, forward+backward, optimizer, communication.

CUDA kernels run asynchronously, so a host clock alone would charge the forward pass's GPU time to
whichever phase next blocks. On CUDA the timer synchronizes at every phase boundary; that costs a
little overlap, so time every step only while diagnosing, or accept a few percent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PHASES = ("data_wait", "fwd_bwd", "optim", "comm")


class StepTimer:
    """``with timer.phase("fwd_bwd"): ...`` inside a step, then ``timer.lap()`` once per step returns
    ``{"data_wait_s": .., "fwd_bwd_s": .., "optim_s": .., "comm_s": .., "step_time_s": ..}``."""

    def __init__(self, device: torch.device | str = "cpu", sync: bool | None = None) -> None:
        dev = torch.device(device)
        self.device = dev
        self.sync = (dev.type == "cuda" and torch.cuda.is_available()) if sync is None else sync
        self._totals: dict[str, float] = {}
        self._lap_start = time.perf_counter()

    def _synchronize(self) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block and add it to ``name`` (phases may repeat within a step, e.g. per
        micro-batch)."""
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Account time measured elsewhere (e.g. a blocking all-reduce timed by the parallel code)."""
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def lap(self) -> dict[str, float]:
        """Phase times since the previous lap plus ``step_time_s`` (wall time), then start afresh.
        The standard phases are always present (0.0 when not measured) so series stay continuous."""
        self._synchronize()
        now = time.perf_counter()
        out = {f"{name}_s": 0.0 for name in PHASES}
        out.update({f"{name}_s": secs for name, secs in self._totals.items()})
        out["step_time_s"] = now - self._lap_start
        self._totals = {}
        self._lap_start = now
        return out
