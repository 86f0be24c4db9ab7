"""Argparse ``type=`` functions that give every numeric flag its range, once, where it enters.

A value out of range is refused by argparse with one line naming the flag (``argument --top-k: -1 is
not >= 0``), exit status 2, before any work starts; the handlers can then trust their arguments.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An integer within [low, high] (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        _check_range(text, value, low, high)
        return value

    parse.__name__ = "integer"  # argparse names the type in its message
    return parse


def float_in(
    low: float | None = None,
    high: float | None = None,
    below: float | None = None,
    above: float | None = None,
) -> Callable[[str], float]:
    """A finite number within [low, high] (or below ``below`` / above ``above``, open ends)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        _check_range(text, value, low, high)
        if below is not None and not value < below:
            raise argparse.ArgumentTypeError(f"{text} is not < {below}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{text} is not > {above}")
        return value

    parse.__name__ = "number"
    return parse


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _check_range(text: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"{text} is not >= {low}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"{text} is not <= {high}")


SEED = int_in(0, 2**63 - 1)
