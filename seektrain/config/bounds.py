"""What values one config key accepts: its range, its choices, and that a number is finite.

A ``Bounds`` is declared next to its key in ``config/schema.py`` (``_key(default, help, min=...)``) and
is the only description of the key's valid values: ``config/loader.py`` checks it, ``seektrain config
keys`` prints it. So a new key gets its range checked and listed by writing one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INT64_MAX = 2**63 - 1  # TOML integers and torch's int64 both end here


@dataclass(frozen=True)
class Bounds:
    min: float | None = None  # value >= min
    max: float | None = None  # value <= max
    above: float | None = None  # value > above (an open lower end, e.g. a learning rate)
    below: float | None = None  # value < below (an open upper end, e.g. Adam's betas)
    choices: tuple[str, ...] = ()  # the only values a string (or each item of a list) may take
    also: tuple = ()  # single values allowed outside the range (e.g. -1 = automatic, 0 = off)
    nonempty: bool = False  # a string that must not be empty

    def problem(self, value) -> str | None:
        """Why ``value`` is refused (the fix included), or None when it is fine."""
        if isinstance(value, list):
            for item in value:
                bad = self.problem(item)
                if bad:
                    return f"item {item!r}: {bad}"
            return None
        if isinstance(value, str):
            if self.nonempty and not value.strip():
                return "must not be empty"
            if self.choices and value not in self.choices:
                return f"use one of {', '.join(self.choices)}"
            return None
        if isinstance(value, bool) or value in self.also:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        if isinstance(value, int) and abs(value) > INT64_MAX:
            return f"must fit in 64 bits (at most {INT64_MAX})"
        in_range = (
            (self.min is None or value >= self.min)
            and (self.max is None or value <= self.max)
            and (self.above is None or value > self.above)
            and (self.below is None or value < self.below)
        )
        return None if in_range else f"must be {self.describe()}"

    def describe(self) -> str:
        """The accepted values in a few words: '>= 1', '(0, 1)', 'fsdp | ddp', '>= 1 or -1'."""
        if self.choices:
            text = " | ".join(self.choices)
        else:
            low = (
                f"[{_num(self.min)}"
                if self.min is not None
                else f"({_num(self.above)}"
                if self.above is not None
                else None
            )
            high = (
                f"{_num(self.max)}]"
                if self.max is not None
                else f"{_num(self.below)})"
                if self.below is not None
                else None
            )
            if low and high:
                text = f"{low}, {high}"
            elif low:
                text = f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
            elif high:
                text = f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
            elif self.nonempty:
                text = "not empty"
            else:
                text = ""
        if self.also:
            text += " or " + " or ".join(_num(v) for v in self.also)
        return text


def _num(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
