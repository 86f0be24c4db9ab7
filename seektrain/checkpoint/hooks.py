"""Test-only fault injection, switched on by environment variables and inert otherwise.

Why here: the failure paths (a rank killed mid-run, a full disk, a NaN loss, a hung rank) are the ones
that matter most and are the hardest to reach on purpose from outside the process. Each hook is one
variable ``SEEKTRAIN_TEST_<NAME>=STEP[:RANK]``: it fires at optimizer step ``STEP`` on rank ``RANK``
(every rank when omitted) and, unless the name says otherwise, on the first attempt of an elastic
job only (``TORCHELASTIC_RESTART_COUNT`` is 0 or unset), so a restarted job can finish.

Hooks used by the code:

    KILL         the rank sends itself SIGKILL at the start of the step (a crashed worker)
    HANG         the rank sleeps for an hour at the start of the step (a hung worker)
    OOM          the step raises torch.OutOfMemoryError at its start (a step that does not fit)
    NAN          the loss of the step becomes NaN before backward (a diverged step)
    CKPT_ENOSPC  writing the checkpoint of the step raises OSError(ENOSPC) (a full disk)
"""

from __future__ import annotations

import os

PREFIX = "SEEKTRAIN_TEST_"


def _parse(value: str) -> tuple[int, int | None]:
    step, _, rank = value.partition(":")
    return int(step), (int(rank) if rank else None)


def first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


def fires(name: str, step: int, rank: int, every_attempt: bool = False) -> bool:
    """True when hook ``name`` is set for this ``step`` and ``rank`` (and attempt)."""
    value = os.environ.get(PREFIX + name)
    if not value:
        return False
    want_step, want_rank = _parse(value)
    if want_step != step or (want_rank is not None and want_rank != rank):
        return False
    return every_attempt or first_attempt()
