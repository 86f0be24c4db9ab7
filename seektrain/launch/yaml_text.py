"""A small YAML writer for Kubernetes manifests: dicts, lists, strings, numbers, booleans and None.

PyYAML is not a runtime dependency, and manifests need nothing beyond block mappings, block lists and
scalars. Strings are written plain only when no YAML 1.1 reader could take them for anything else
(a number, a boolean such as ``on``, null, a key, a comment); every other string is written
double-quoted, with every character YAML would not keep as it is (a quote, a backslash, a line break such
as U+2028 or NEL, a control character) escaped, so any value arrives intact and can never end the
scalar. A multi-line string ending in one newline (a config file in a ConfigMap) is written as a ``|``
block so it stays readable.
"""

from __future__ import annotations

import json
import re

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
# YAML 1.1 words that read as booleans or null (PyYAML and Go's yaml.v2 both resolve these).
_RESERVED = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return _quoted(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _quoted(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable() and ch != "\ufeff":  # a BOM is "printable" but YAML readers drop it
            out.append(ch)
        else:  # control characters, line and paragraph separators, unassigned code points
            code = ord(ch)
            out.append(
                f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
            )
    return '"' + "".join(out) + '"'


def _is_block_text(value) -> bool:
    return (
        isinstance(value, str)
        and "\n" in value
        and value.endswith("\n")
        and not value.endswith("\n\n")
        and not value.startswith((" ", "\n"))
        and all(ch == "\n" or ch.isprintable() for ch in value)
    )


def _block_text(text: str, indent: int) -> list[str]:
    pad = " " * indent
    return [f"{pad}{line}" if line else "" for line in text[:-1].split("\n")]


def _entry(prefix: str, value, indent: int) -> list[str]:
    """``prefix`` is ``key:`` or ``-``; the value follows on the same line or indented below it."""
    if isinstance(value, dict) and value:
        return [prefix] + _mapping(value, indent + 2)
    if isinstance(value, list) and value:
        return [prefix] + _sequence(value, indent + 2)
    if isinstance(value, (dict, list)):
        return [f"{prefix} {'{}' if isinstance(value, dict) else '[]'}"]
    if _is_block_text(value):
        return [f"{prefix} |"] + _block_text(value, indent + 2)
    return [f"{prefix} {_scalar(value)}"]


def _mapping(mapping: dict, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for key, value in mapping.items():
        assert isinstance(key, str), key
        entry = _entry(f"{_scalar(key)}:", value, indent)
        lines += [pad + entry[0]] + entry[1:]
    return lines


def _sequence(items: list, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for item in items:
        if isinstance(item, dict) and item:
            # the first key sits after the dash; the rest line up under it
            body = _mapping(item, indent + 2)
            lines += [pad + "- " + body[0].lstrip(" ")] + body[1:]
        else:
            entry = _entry("-", item, indent)
            lines += [pad + entry[0]] + entry[1:]
    return lines


def to_yaml(document: dict) -> str:
    """One YAML document for a mapping."""
    return "\n".join(_mapping(document, 0)) + "\n"


def to_yaml_documents(documents: list[dict]) -> str:
    """Several documents in one stream, each started by ``---`` (what ``kubectl apply -f`` reads)."""
    return "".join("---\n" + to_yaml(doc) for doc in documents)
