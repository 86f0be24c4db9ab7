"""Deterministic, resumable, data-parallel batches of token windows.

The rules (also in docs/data.md):

* The split's token stream is cut into ``W = (N - 1) // seq_len`` windows; window ``k`` is tokens
  ``[k·T, k·T + T + 1)``, inputs ``w[:-1]`` and labels ``w[1:]``. Consecutive windows share one token,
  so every token after the first is a label exactly once per epoch.
* Epoch ``e`` visits the windows in the order ``permutation(W)`` drawn from ``numpy`` with seed
  ``(seed, e)``; that global order does not depend on the number of ranks.
* A global batch is the next ``G = micro_batch_size · dp_size`` windows of that order; inside it,
  window ``j`` goes to rank ``j % dp_size`` (round-robin). Ranks never overlap and all ranks get the
  same number of windows. When fewer than ``G`` windows remain, they are dropped and the next epoch
  starts, so there is never a short or uneven batch.
* The position is kept as (epoch, global windows consumed in that epoch), so a state saved with one
  ``dp_size`` loads with another: the next global batch holds the same windows whenever ``G`` is the
  same (e.g. 2 ranks × 4 → 1 rank × 8, or 1 rank × 4 with 2 gradient-accumulation steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from seektrain.data.batch import Batch
from seektrain.data.dataset import TokenDataset, verify_dataset
from seektrain.data.packing import cuts_in, row_fields, rows_of, window_fields
from seektrain.errors import UserError

__all__ = ["DistributedBatchLoader", "TokenDataset", "verify_dataset"]

STATE_VERSION = 1


class DistributedBatchLoader:
    """Iterator over ``Batch`` (``data/batch.py``) of LongTensors of shape ``[micro_batch_size, seq_len]`` for one rank.

    Iteration never ends: epochs roll over automatically. For one pass (validation) take
    ``itertools.islice(loader, loader.steps_per_epoch)`` from a fresh loader.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        packing: bool = False,
        document_mask: bool = False,
    ) -> None:
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_len={seq_len}, micro_batch_size={micro_batch_size}: both must be >= 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"dp_rank={dp_rank}, dp_size={dp_size}: need dp_size >= 1 and 0 <= dp_rank < dp_size"
            )
        if seed < 0:
            raise ValueError(f"seed={seed}: must be a non-negative integer")
        self.dataset = dataset
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        # windows of the stream, rows of packed documents, or one (chat) document per row
        self.layout = "packed" if packing else "documents" if dataset.has_mask else "windows"
        self.document_mask = packing or document_mask  # fill positions and document ids
        self._ends = np.empty(0, dtype=np.int64)  # document ends, read where positions or rows need them
        if self.document_mask or self.layout != "windows":
            self._ends = dataset.document_ends()
        self._rows: np.ndarray | None = None
        where = f"data.path={dataset.directory} ({dataset.split})"
        if self.layout == "windows":
            self.num_windows = (len(dataset) - 1) // seq_len
            units = f"{len(dataset)} tokens give {self.num_windows} windows of seq_len+1={seq_len + 1}"
        else:
            self._rows = rows_of(self._ends, seq_len, self.layout, dataset.has_mask, where)
            self.num_windows = len(self._rows)
            units = f"{len(self._ends)} documents give {self.num_windows} rows of seq_len={seq_len}"
        self.global_batch = micro_batch_size * dp_size
        if self.num_windows < self.global_batch:
            raise UserError(
                f"{where}: {units}, fewer than one global batch of {self.global_batch} (micro_batch × dp); "
                "use a shorter seq_len, a smaller batch or more data"
            )
        self.pad_id = dataset.manifest.tokenizer.eos_id
        self.epoch = 0
        self.offset = 0  # global windows consumed in the current epoch
        self.consumed_windows = 0  # global windows consumed over all epochs
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows // self.global_batch

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.num_windows)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def __iter__(self) -> DistributedBatchLoader:
        return self

    def __next__(self) -> Batch:
        if self.offset + self.global_batch > self.num_windows:
            self.epoch += 1
            self.offset = 0
        order = self._epoch_order()
        mine = order[self.offset + self.dp_rank : self.offset + self.global_batch : self.dp_size]
        self.offset += self.global_batch
        self.consumed_windows += self.global_batch
        if self.layout == "windows" and not self.document_mask:
            width = self.seq_len + 1
            batch = np.empty((self.micro_batch_size, width), dtype=np.int64)
            for row, window in enumerate(mine):
                batch[row] = self.dataset.read(int(window) * self.seq_len, width)
            t = torch.from_numpy(batch)
            return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous())
        fields = np.stack([np.stack(self._fields(int(unit))) for unit in mine], axis=1)  # [4, B, T]
        tokens, labels, positions, document_ids = (torch.from_numpy(f) for f in fields)
        if not self.document_mask:  # one document per row, padded at the end: plain causal attention is exact
            return Batch(tokens, labels)
        return Batch(tokens, labels, positions, document_ids)

    def _fields(self, unit: int) -> tuple[np.ndarray, ...]:
        """(tokens, labels, positions, document_ids) of window or row ``unit``."""
        if self._rows is None:
            start, stop = unit * self.seq_len, unit * self.seq_len + self.seq_len + 1
            window, mask = self.dataset.read(start, stop - start), self.dataset.read_mask(start, stop - start)
            return window_fields(window, mask, cuts_in(self._ends, start, stop))
        start, stop = (int(x) for x in self._rows[unit])
        tokens, mask = self.dataset.read(start, stop - start), self.dataset.read_mask(start, stop - start)
        return row_fields(tokens, mask, cuts_in(self._ends, start, stop), self.seq_len, self.pad_id)

    def tokens_consumed(self) -> int:
        """Input tokens this rank has been served: its equal share of the global count (exact per rank)."""
        return self.consumed_windows * self.seq_len // self.dp_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "consumed_windows": self.consumed_windows,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
            "global_batch": self.global_batch,
            "layout": self.layout,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; dp_size and micro_batch_size may differ from the saving run."""
        if state.get("version") != STATE_VERSION:
            raise UserError(
                f"data loader state version {state.get('version')!r} is not {STATE_VERSION}; resume "
                "with the seektrain that saved it"
            )
        if state.get("layout", "windows") != self.layout:
            raise UserError(
                f"data loader state is of {state.get('layout', 'windows')} rows but this run reads "
                f"{self.layout} rows (data.packing or the data changed); resume with the same data and "
                "data.packing (or start a fresh run)"
            )
        for key in ("seed", "seq_len", "num_windows"):
            if state[key] != getattr(self, key):
                raise UserError(
                    f"data loader state has {key}={state[key]} but this run has {getattr(self, key)}; "
                    "resume with the same data, seed and seq_len (or start a fresh run)"
                )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.consumed_windows = int(state["consumed_windows"])
