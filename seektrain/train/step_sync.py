"""The one all-reduce at the end of every step: whether any rank got SIGTERM, and whether an async
checkpoint has finished writing everywhere.

Why one collective for both: a collective per step costs latency on every step of every run, and the
two questions are asked at the same moment by every rank, so they ride together (MAX over two flags;
``benchmarks/bench_step_syncs.py`` counts it). Why read one step late: reading the flags right after
the all-reduce would wait for the device's queued work, so the flags all-reduced after step N are read
after step N + 1 (their copy to the host is queued right behind the all-reduce). Every rank still stops
at the *same* step (one after the signal was seen), saves it and exits with status 143
(``preemption.py`` handles the signal itself; during training its handler only sets a flag), and the
trainer has the checkpoint manager commit an async save as early as every rank has written it.

``begin_step`` names the step for the lines of a preemption or a failed collective (the preemption's
``phase``) and keeps ``step`` for ``readable_failure``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seektrain.train.preemption import Preemption
from seektrain.train.transfer import HostCopy


class StepSync:
    """``begin_step`` / ``end_step`` around every step of the training loop."""

    def __init__(self, preemption: Preemption, device: torch.device):
        self.preemption, self.device = preemption, device
        self.step: int | None = None
        self._in_transit: tuple[HostCopy, int | None] | None = None  # the last step's flags (several ranks)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.preemption.phase = (
            f"step {step} (its FSDP all-gather/reduce-scatter, all-reduces, or the checkpoint after it)"
        )

    def end_step(
        self, step: int, writing: bool = False, pending: int | None = None
    ) -> tuple[bool, int | None]:
        """After every step: (any rank got SIGTERM, so every rank stops at this step; the async save
        ``pending`` once no rank is ``writing`` it any more, for the caller to commit, else None). The
        commit is the checkpoint manager's (``CheckpointManager.commit``). One process decides from its
        own flags; several all-reduce them."""
        flags = [float(self.preemption.received is not None), float(writing)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.preemption.phase = f"the stop-flag all-reduce after step {step}"
            exchanged = self._exchange(flags, pending)
            if exchanged is None:
                return False, None
            flags, pending = exchanged
        written = pending if pending is not None and flags[1] == 0 else None
        if written is not None:
            self.preemption.phase = f"the commit of an async checkpoint after step {step}"
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
