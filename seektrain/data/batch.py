"""One micro-batch as the loader hands it to the step: the contract between ``data/`` and ``train/``.

Why a type and not a ``(tokens, labels)`` pair: packed chat data and document-masked pretraining need
to say, per token, which document it belongs to and where in that document it sits, and the model,
the loss and (later) context parallelism all read the same two tensors. Keeping them in one object
means the prefetch thread pins, and the step moves, every part of a batch the same way.

Shapes are ``[B, T]`` (micro_batch_size, seq_len), all int64:

* ``tokens``: input ids.
* ``labels``: the id to predict at each position, or ``IGNORE`` (-100) where nothing is trained: a
  masked (e.g. prompt) token, the last token of a document (its successor is another document), and
  padding.
* ``positions``: RoPE positions, restarting at 0 where a document starts; ``None`` means
  ``0 .. T-1`` in every row (plain windows of one token stream).
* ``document_ids``: a number per token, equal within a document and different between neighbours;
  attention is causal *within* a document only, and MTP never predicts across a change of id.
  Padding at the end of a row is a document of its own. ``None`` means one document per row (plain
  causal attention, the fast path).

Context parallelism (``seektrain/parallel/context_parallel.py``) hands the model a rank's chunks of a
row, which are not contiguous, so what reads neighbouring tokens is decided on the whole row before the
split: with MTP its ``labels`` are each head's targets ``[B, T, 1 + depths]`` and ``mtp_tokens`` each
depth's input tokens ``[B, T, depths]`` (``None``: the model shifts ``tokens`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# A label that trains nothing: torch.nn.functional.cross_entropy's default ignore_index, which the model's
# loss uses too (models/linear_cross_entropy.IGNORE; tests/test_data_packing.py holds the two equal).
IGNORE = -100


@dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    mtp_tokens: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        """True when rows hold several documents (the model needs positions and a document mask)."""
        return self.document_ids is not None

    def _map(self, fn) -> Batch:
        return Batch(
            **{
                f.name: None if (t := getattr(self, f.name)) is None else fn(t)  # type: ignore[arg-type]
                for f in fields(self)
            }
        )  # (tokens and labels are never None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())
