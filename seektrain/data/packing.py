"""Rows of whole documents, and the per-token fields of a row: labels, positions, document ids.

A *row* is a span ``[start, end)`` of a split's token stream of at most ``seq_len`` tokens; the loader
pads it at the end. Three ways to cut a split into rows (``rows_of``):

* ``packed`` (``data.packing``): greedy next-fit in stored order: documents are appended to the
  current row while they fit; the next one that does not starts a new row. A document longer than
  ``seq_len`` is cut into pieces of ``seq_len`` (each its own document in the row) when the data has
  no loss mask (pretraining text); a masked (chat) document that long is refused with one line, since
  a conversation cut in two trains its second half without the prompt it answers.
* ``documents`` (a masked dataset, packing off): one document per row, padded; longer ones refused
  as above.
* windows (plain corpora) are not rows: see ``window_fields``.

Fields (``row_fields``/``window_fields``): a label is the next token of the *same* document where that
token's loss mask is 1, else ``IGNORE`` (the last token of every document, masked tokens, padding);
positions restart at 0 at every document start and at the row's first token; document ids count the
documents of the row from 0, padding taking the next id.
"""

from __future__ import annotations

import numpy as np

from seektrain.data.batch import IGNORE
from seektrain.errors import UserError


def rows_of(ends: np.ndarray, seq_len: int, layout: str, masked: bool, where: str) -> np.ndarray:
    """``[R, 2]`` int64 (start, end) of each row, in stream order; ValueError for a masked document
    longer than ``seq_len`` (``where`` names the dataset in the message)."""
    ends = np.asarray(ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    longest = int(lengths.max()) if lengths.size else 0
    if longest > seq_len and (masked or layout == "documents"):
        doc = int(np.argmax(lengths))
        raise UserError(
            f"{where}: document {doc} has {longest} tokens, more than train.seq_len={seq_len}; "
            f"re-prepare with --max-len {seq_len} (--overlong drop|truncate) or raise train.seq_len"
        )
    if layout == "documents":
        return np.stack([starts, ends], axis=1)
    rows: list[tuple[int, int]] = []
    row_start = row_end = 0
    for start, end in zip(starts.tolist(), ends.tolist()):
        if end - row_start <= seq_len:
            row_end = end
            continue
        if row_end > row_start:
            rows.append((row_start, row_end))
        row_start = start
        while end - row_start > seq_len:  # only unmasked text gets here: cut into seq_len pieces
            rows.append((row_start, row_start + seq_len))
            row_start += seq_len
        row_end = end
    if row_end > row_start:
        rows.append((row_start, row_end))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 2)


def row_fields(
    tokens: np.ndarray, mask: np.ndarray, cuts: np.ndarray, seq_len: int, pad_id: int
) -> tuple[np.ndarray, ...]:
    """(tokens, labels, positions, document_ids), each ``[seq_len]``, of one row.

    ``tokens``/``mask``: the row's ``n <= seq_len`` stored tokens and their loss mask; ``cuts``: the
    offsets in ``(0, n)`` where a new document starts.
    """
    n = tokens.size
    fields = _fields(tokens, mask, cuts, n)
    pad = seq_len - n  # padding is a document of its own: the next id, positions from 0
    tail = (
        np.full(pad, pad_id),
        np.full(pad, IGNORE),
        np.arange(pad),
        np.full(pad, fields[3][-1] + 1 if n else 0),
    )
    return tuple(np.concatenate([f, t]).astype(np.int64) for f, t in zip(fields, tail))


def window_fields(window: np.ndarray, mask: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, ...]:
    """(tokens, labels, positions, document_ids) of a plain window of ``T + 1`` stored tokens (inputs
    ``w[:-1]``, labels ``w[1:]``), with the documents ``cuts`` (offsets in ``(0, T + 1)``) marks."""
    return _fields(window, mask, cuts, window.size - 1)


def _fields(stream: np.ndarray, mask: np.ndarray, cuts: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """The fields of the first ``n`` positions of ``stream``; an element past ``n`` is only a label."""
    stream = np.asarray(stream, dtype=np.int64)
    starts = np.zeros(stream.size, dtype=bool)
    starts[0] = True
    starts[cuts] = True
    m = min(n, stream.size - 1)  # positions whose successor is in the stream
    labels = np.full(n, IGNORE, dtype=np.int64)
    trained = ~starts[1 : m + 1] & (np.asarray(mask[1 : m + 1]) != 0)
    labels[:m] = np.where(trained, stream[1 : m + 1], IGNORE)
    index = np.arange(n)
    last_start = np.maximum.accumulate(np.where(starts[:n], index, 0))
    return stream[:n].copy(), labels, index - last_start, np.cumsum(starts[:n]) - 1


def cuts_in(ends: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Offsets from ``start`` of the document starts strictly inside ``(start, stop)``."""
    lo = int(np.searchsorted(ends, start, side="right"))
    hi = int(np.searchsorted(ends, stop, side="left"))
    return np.asarray(ends[lo:hi], dtype=np.int64) - start
