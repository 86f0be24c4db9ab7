"""Regional ``torch.compile``: each decoder block (and MTP module) is compiled on its own, in place.

Why per block rather than the whole model: every block has the same code, so one compiled graph
serves them all (parameters are graph inputs), compile time stays that of one block, and FSDP's
per-block hooks, tensor-parallel DTensors and activation-checkpoint wrappers stay outside the graph
(torchtitan's order: tensor parallel, activation checkpointing, compile, then FSDP). ``Module.compile``
keeps the module and its parameter names, so checkpoints do not change. On CPU it is off by default:
it cost minutes of compile for a few percent (docs/benchmarks.md).
"""

from __future__ import annotations

import logging

from torch import nn

from seektrain.models.registry import model_blocks

log = logging.getLogger("seektrain.parallel")


def apply_compile(model: nn.Module) -> int:
    """Compile every block of ``model`` (a model of a registered family, or a pipeline stage of one)
    in place; returns how many. Compilation itself happens at each block's first call."""
    blocks = model_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)
