"""What a dataset calls its columns and roles (``--columns``, ``--roles``), checked before any file is read.

Public datasets hold the usual formats under their own names (``conv`` for the turns, ``question`` for
the instruction...). A mapping renames them to the names a format's reader expects instead of making
users rewrite their files; the keys are the internal names, the values what the data says, as in
LLaMA-Factory's ``dataset_info.json`` ``columns`` and ``tags``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seektrain.errors import UserError

COLUMN_KEYS = (
    "messages",
    "role",
    "content",
    "system",
    "instruction",
    "input",
    "output",
    "history",
    "prompt",
    "completion",
)
ROLE_KEYS = ("user", "assistant", "system", "tool", "function_call")
_DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "chat": {"messages": "messages", "role": "role", "content": "content"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value", "system": "system"},
}
# role -> the tags a format's data uses for it (ShareGPT also takes the OpenAI names)
_DEFAULT_TAGS: dict[str, dict[str, tuple[str, ...]]] = {
    "chat": {"user": ("user",), "assistant": ("assistant",), "system": ("system",), "tool": ("tool",)},
    "sharegpt": {
        "user": ("human", "user"),
        "assistant": ("gpt", "assistant"),
        "system": ("system",),
        "tool": ("observation", "tool"),
        "function_call": ("function_call",),
    },
}


@dataclass(frozen=True)
class RowMapping:
    columns: dict[str, str] = field(default_factory=dict)  # internal column name -> the data's
    roles: dict[str, str] = field(default_factory=dict)  # internal role -> the data's tag

    def column(self, kind: str, key: str) -> str:
        return self.columns.get(key) or _DEFAULT_COLUMNS.get(kind, {}).get(key, key)

    def tags(self, kind: str) -> dict[str, str]:
        """The data's role tag -> internal role, for a chat or ShareGPT row."""
        out: dict[str, str] = {}
        for role, tags in _DEFAULT_TAGS[kind].items():
            for tag in (self.roles[role],) if role in self.roles else tags:
                out.setdefault(tag, role)
        return out

    def is_plain(self, kind: str) -> bool:
        """Whether rows of ``kind`` are read as they are: nothing renamed for them."""
        keys = ("role", "content") + (("system",) if kind == "sharegpt" else ())
        return not self.roles and not any(k in self.columns for k in keys)


def parse_mapping(columns: str | None, roles: str | None) -> RowMapping:
    """``--columns messages=conv,role=from`` and ``--roles user=human,assistant=gpt``, each pair checked."""
    return RowMapping(_pairs("--columns", columns, COLUMN_KEYS), _pairs("--roles", roles, ROLE_KEYS))


def _pairs(flag: str, text: str | None, keys: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not value:
            raise UserError(f"{flag} {item!r}: write KEY=NAME pairs separated by commas, e.g. {keys[0]}=conv")
        if key not in keys:
            raise UserError(f"{flag} {key!r}: unknown key; use one of {', '.join(keys)}")
        if key in out:
            raise UserError(f"{flag} {key!r}: given twice")
        out[key] = value
    return out
