"""Every rank stops at the same batch, with the same line, when any rank finds a damaged shard block.

Why: data-parallel ranks read different windows, so only the rank whose batch holds the damaged block
notices (``blocks.py``). Were it simply to raise, its peers would wait in the step's collectives until
its exit broke them and end with a "collective failed" line that hides the cause. So after each batch
every rank all-reduces (MIN) the number of the first damaged block it met, or ``NONE``, over a gloo
group of its own; with read-ahead (``data.prefetch`` > 0) this runs in the prefetch thread, off the
step's path. A block number decodes to the same file and byte range on every rank
(``TokenDataset.damage``), so every rank raises the same ``ShardDamaged`` for that batch, before any
rank trains on it, and the trainer stops every rank at the same step.

The exchange runs whether or not the folder has block checksums: whether to take part in a collective
must never depend on a file a node might hold in another version.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from seektrain.data.batch import Batch
from seektrain.data.blocks import ShardDamaged

NONE = 1 << 62  # no damaged block (above any block number)


class AgreedBatches:
    """The batches of ``loader`` (a ``DistributedBatchLoader``), each agreed undamaged by all ranks of
    ``group``; ``state_dict``/``load_state_dict`` are the loader's."""

    def __init__(self, loader, group) -> None:
        self.loader, self.group = loader, group

    def __iter__(self) -> AgreedBatches:
        return self

    def __next__(self) -> Batch:
        code, batch = NONE, None
        try:
            batch = next(self.loader)
        except ShardDamaged as err:
            code = err.code
        first = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.group)
        if int(first) != NONE:
            raise self.loader.dataset.damage(int(first))
        assert batch is not None
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def agreed(loader, timeout_s: float):
    """``loader`` itself in a world of one; else ``AgreedBatches`` over a new gloo group of all ranks
    (a collective: every rank calls this at the same point of start-up)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return loader
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return AgreedBatches(loader, group)
