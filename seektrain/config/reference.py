"""Every config key with its type, default, accepted values and help, read from the schema (``seektrain config keys``).

The listing is generated, never written by hand, so it cannot drift from what the loader accepts.
"""

from __future__ import annotations

import json
import typing
from typing import NamedTuple

from seektrain.config.loader import leaf_keys
from seektrain.config.schema import JobConfig


class KeyDoc(NamedTuple):
    key: str  # section.key, as TOML and --set spell it
    type: str
    default: str  # as it would be written in TOML
    range: str  # the values it accepts, from its schema Bounds ('>= 1', 'fsdp | ddp'; '' = any)
    help: str


def _type_name(typ: object) -> str:
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        return f"list[{item.__name__}]"
    return typ.__name__  # type: ignore[attr-defined]


def config_keys(cfg: JobConfig | None = None) -> list[KeyDoc]:
    """One row per key, in schema order; defaults are those of ``cfg`` (the built-in ones by default)."""
    cfg = cfg or JobConfig()
    rows = []
    for dotted, section, f in leaf_keys(cfg):
        bounds = f.metadata.get("bounds")
        rows.append(
            KeyDoc(
                dotted,
                _type_name(typing.get_type_hints(type(section))[f.name]),
                json.dumps(getattr(section, f.name)),
                bounds.describe() if bounds else "",
                f.metadata.get("help", ""),
            )
        )
    return rows


def format_keys(rows: list[KeyDoc], markdown: bool = False) -> str:
    """Aligned plain-text columns, or a Markdown table (what docs/configuration.md holds)."""
    if markdown:
        lines = ["| key | type | default | accepts | help |", "|---|---|---|---|---|"]
        bar = "\\|"  # a | inside a table cell
        lines += [
            f"| `{r.key}` | {r.type} | `{r.default}` | {r.range.replace('|', bar)} | {r.help.replace('|', bar)} |"
            for r in rows
        ]
        return "\n".join(lines) + "\n"
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "".join(
        f"{r.key:<{widths[0]}}  {r.type:<{widths[1]}}  {r.default:<{widths[2]}}  {r.range:<{widths[3]}}  "
        f"{r.help}\n"
        for r in rows
    )
