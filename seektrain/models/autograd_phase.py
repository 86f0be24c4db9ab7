"""Whether autograd is running a backward pass: activation-checkpoint recomputation replays a block's
forward inside backward, and whatever a forward counts (the routers' expert load, the balance loss's
statistics) must not count it twice. Shared by the MoE layer and the trainer's balance statistics."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1
