"""Which decoder layers recompute their activations, read from ``train.activation_checkpoint`` in one
place: by the planner's memory and time models and by ``parallel/activation_checkpoint.py``, which wraps
those layers (the planner imports nothing of parallel/, so the reading lives here)."""

from __future__ import annotations

SELECTIVE = "selective"


def checkpoint_every(mode: str) -> int:
    """Which layers are checkpointed: 0 for none, 1 for full and selective (every layer), K for every:K."""
    if mode == "none":
        return 0
    if mode in ("full", SELECTIVE):
        return 1
    return int(mode.split(":", 1)[1])
