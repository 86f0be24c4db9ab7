"""Several inputs mixed by weight (``--input a.jsonl:0.7 --input b.parquet:0.3``).

The documents are interleaved by a weighted round robin, not by a random draw: each next document
comes from the input furthest behind its share (the smallest ``(taken + 0.5) / weight``, ties to the
first input), so every prefix of the dataset holds each input's share to within one document, and the
same inputs always give the same dataset (the shards, and so a run's data position, need no seed to
reproduce). The mix ends when the input whose turn it is runs out, so the proportions hold for the
whole dataset; the documents taken from each are counted in the manifest's ``sources``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from seektrain.errors import UserError

T = TypeVar("T")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def parse_input(raw: str | Path) -> tuple[str | Path, float | None]:
    """``PATH`` or ``PATH:WEIGHT``: the part after the last ``:`` is a weight only when it is a number and
    the whole is not an existing path (so ``C:/data`` or ``run:1/x.jsonl`` stay paths)."""
    if isinstance(raw, Path):
        return raw, None
    head, sep, tail = raw.rpartition(":")
    if not sep or not head or not _NUMBER.fullmatch(tail.strip()) or Path(raw).expanduser().exists():
        return raw, None
    weight = float(tail)
    if not math.isfinite(weight) or weight <= 0:
        raise UserError(f"--input {raw}: weight {tail} must be a number above 0, e.g. {head}:0.5")
    return head, weight


def parse_inputs(inputs: Sequence[str | Path]) -> tuple[list[str | Path], list[float] | None]:
    """The paths, and their weights when the inputs are mixed (all weighted, or none)."""
    parsed = [parse_input(raw) for raw in inputs]
    weighted = [raw for raw, (_, w) in zip(inputs, parsed) if w is not None]
    if not weighted:
        return [p for p, _ in parsed], None
    if len(weighted) != len(parsed):
        plain = next(raw for raw, (_, w) in zip(inputs, parsed) if w is None)
        raise UserError(
            f"--input {plain}: has no weight while {weighted[0]} has one; give every --input a weight "
            "(PATH:WEIGHT) or none"
        )
    return [p for p, _ in parsed], [w for _, w in parsed if w is not None]


def interleave(streams: Sequence[Iterator[T]], weights: Sequence[float]) -> Iterator[T]:
    """The items of ``streams`` in the weighted round robin's order, until the stream due runs out."""
    taken = [0] * len(streams)
    while True:
        i = min(range(len(streams)), key=lambda k: ((taken[k] + 0.5) / weights[k], k))
        try:
            item = next(streams[i])
        except StopIteration:
            return
        taken[i] += 1
        yield item
