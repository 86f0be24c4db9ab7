"""The one line an error of the training loop ends the run with, when it is a known failure: out of
memory, or a collective that failed (a dead, hung or unreachable rank).

Why: a traceback from deep in torch says neither what this job should change nor which rank or node
stopped answering; the user needs one line with the cheapest fix (``out_of_memory.py``) or the rank,
the moment and the peers (``collective_failure.py``). Anything else stays what it is (a bug, whose
traceback goes to ``train.log``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seektrain.errors import RunFailure
from seektrain.train.collective_failure import CollectiveError, is_collective_failure, peers_text, where_text
from seektrain.train.out_of_memory import is_out_of_memory, out_of_memory_error


@dataclass
class FailedAt:
    """Where the run was when it failed: this rank, the step running (None: start-up), what the run
    was doing (the preemption's ``phase``), every rank's host and address (``dist_env.node_facts``) and
    ``dist.collective_timeout_s``."""

    rank: int
    step: int | None
    phase: str
    facts: list[dict] = field(default_factory=list)
    timeout_s: float = 600.0


def readable_failure(err: BaseException, plan, at: FailedAt) -> RunFailure | None:
    """A one-line ``OutOfMemory`` naming the cheapest fix for ``plan`` (when there is a plan), or a
    one-line ``CollectiveError`` for a backend's collective failure; None for any other error."""
    if plan is not None and is_out_of_memory(err):
        return out_of_memory_error(
            err, plan, at.rank, f"step {at.step}" if at.step is not None else "start-up"
        )
    if not is_collective_failure(err):
        return None
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    detail = detail.split("] ", 1)[-1] if detail.startswith("[") else detail
    detail = detail.split(". ", 1)[0].rstrip(".")  # gloo appends advice sentences; keep the fact
    return CollectiveError(
        f"rank {at.rank}{where_text(at.facts, at.rank)}: a collective failed during {at.phase}: "
        f"{detail[:300]}. It waits on {peers_text(at.facts, at.rank)}: one of them died or is stuck "
        f"(see its log), or the network to its node is down; if it is only slow raise "
        f"dist.collective_timeout_s (now {at.timeout_s:g} s)"
    )
