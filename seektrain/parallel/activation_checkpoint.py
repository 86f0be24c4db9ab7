"""Activation checkpointing of decoder layers: none, every layer ("full"), or every K-th ("every:K").

Checkpointed layers keep only their input and recompute the rest during backward: about one extra
forward of compute for a large cut in activation memory.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def checkpoint_every(mode: str) -> int:
    """0 for none, 1 for full, K for every:K."""
    if mode == "none":
        return 0
    if mode == "full":
        return 1
    return int(mode.split(":", 1)[1])


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Wrap layers in place; returns how many were wrapped."""
    every = checkpoint_every(mode)
    if not every:
        return 0
    wrapped = 0
    for key, layer in list(model.layers.items()):
        if int(key) % every == 0:
            model.layers[key] = checkpoint_wrapper(layer, preserve_rng_state=False)
            wrapped += 1
    return wrapped
