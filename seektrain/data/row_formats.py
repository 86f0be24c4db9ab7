"""The row formats of JSONL/JSON/Parquet/Arrow inputs, which one a row is, and its conversation.

ShareGPT and Alpaca rows become the same ``messages`` list an OpenAI-style row holds, so they are
rendered by the chat template and masked exactly as that list would be (``rows.py``): there is one
renderer and one mask rule, whatever the format. The conversions follow LLaMA-Factory's, the tool that
made these formats common: an Alpaca prompt is ``instruction`` and ``input`` joined by a newline,
``history`` pairs come before it, and ShareGPT's ``function_call``/``observation`` turns are the
assistant's tool calls and the tool's answers.

A file holds one format: the first row says which (or ``--format``), and a later row of another
format is refused rather than read as something it is not.
"""

from __future__ import annotations

import json
from typing import Any

from seektrain.data.row_mapping import RowMapping
from seektrain.errors import UserError

CHAT_KINDS = ("chat", "sharegpt", "alpaca")  # rendered by the chat template
ROW_KINDS = ("text", *CHAT_KINDS, "completion")
DETECT_ORDER = ("chat", "sharegpt", "alpaca", "text", "completion")  # the first that fits wins
_ASSISTANT_SIDE = ("assistant", "function_call")


def required(kind: str, mapping: RowMapping, text_field: str) -> tuple[str, ...]:
    """The fields a row of ``kind`` must have, as this dataset names them."""
    col = mapping.column
    if kind == "text":
        return (text_field,)
    if kind in ("chat", "sharegpt"):
        return (col(kind, "messages"),)
    if kind == "alpaca":
        return (col(kind, "instruction"), col(kind, "output"))
    return (col(kind, "prompt"), col(kind, "completion"))


def fits(kind: str, record: Any, mapping: RowMapping, text_field: str) -> bool:
    return isinstance(record, dict) and all(k in record for k in required(kind, mapping, text_field))


def _named(kind: str, mapping: RowMapping, text_field: str) -> str:
    return f"{kind} ({', '.join(repr(k) for k in required(kind, mapping, text_field))})"


def detect(where: str, record: Any, mapping: RowMapping, text_field: str) -> str:
    """The format of a file's first row; UserError naming the formats tried when it fits none."""
    for kind in DETECT_ORDER:
        if fits(kind, record, mapping, text_field):
            return kind
    tried = ", ".join(_named(k, mapping, text_field) for k in DETECT_ORDER)
    got = (
        f"fields {', '.join(repr(k) for k in list(record)[:8])}"
        if isinstance(record, dict)
        else f"a {type(record).__name__}"
    )
    raise UserError(
        f"{where}: the row fits none of the formats tried: {tried}; it has {got}; pass --format, "
        "--columns or --text-field"
    )


def check_fits(where: str, kind: str, record: Any, mapping: RowMapping, text_field: str) -> None:
    """UserError unless ``record`` is a row of ``kind``, naming the format it is when it is another."""
    if fits(kind, record, mapping, text_field):
        return
    other = next((k for k in DETECT_ORDER if fits(k, record, mapping, text_field)), None)
    expected = _named(kind, mapping, text_field)
    if other is None:
        names = required(kind, mapping, text_field)
        missing = next((k for k in names if not isinstance(record, dict) or k not in record), names[0])
        raise UserError(
            f"{where}: no field {missing!r} of a {expected} row (nor the fields of another format); fix or "
            f"remove the row, or pass {'--text-field' if kind == 'text' else '--columns'}"
        )
    raise UserError(
        f"{where}: a {other} row in a file of {expected} rows (as its first row or --format says): a file "
        "holds one format; split the file by format"
    )


def to_messages(kind: str, record: dict[str, Any], mapping: RowMapping) -> Any:
    """The ``messages`` list of a chat, ShareGPT or Alpaca row; UserError for a malformed one."""
    if kind == "alpaca":
        return _alpaca(record, mapping)
    turns = record[mapping.column(kind, "messages")]
    if kind == "chat" and mapping.is_plain("chat"):
        return turns
    return _conversation(kind, turns, record, mapping)


def _conversation(kind: str, turns: Any, record: dict[str, Any], mapping: RowMapping) -> Any:
    """Turns renamed to ``role``/``content`` with the internal role names; ShareGPT's must alternate."""
    if not isinstance(turns, list):
        return turns  # check_messages says what is wrong with it
    role_key, content_key = mapping.column(kind, "role"), mapping.column(kind, "content")
    tags = mapping.tags(kind)
    out: list[Any] = []
    system = record.get(mapping.column(kind, "system")) if kind == "sharegpt" else None
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    side = None  # the side of the last non-system turn
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            out.append(turn)
            continue
        tag = turn.get(role_key)
        role = tags.get(tag) if isinstance(tag, str) else None
        if role is None:
            known = ", ".join(tags)
            raise UserError(f"turn {i} has unknown role {tag!r} (field {role_key!r}); the roles are {known}")
        rest = {k: v for k, v in turn.items() if k not in (role_key, content_key)}
        if kind == "sharegpt":
            if role == "system":
                if side is not None:
                    raise UserError(f"turn {i} ({tag}): a system turn comes only first")
            else:
                now = "assistant" if role in _ASSISTANT_SIDE else "user"
                if now == side or (side is None and now == "assistant"):
                    raise UserError(
                        f"turn {i} ({tag}) follows a {side or 'start of the'} turn: a ShareGPT conversation "
                        "alternates human/observation and gpt/function_call turns, starting with human"
                    )
                side = now
        if role == "function_call":
            out.append(
                {
                    **rest,
                    "role": "assistant",
                    "content": None,
                    "tool_calls": _tool_calls(i, turn, content_key),
                }
            )
        else:
            out.append({**rest, "role": role, "content": turn.get(content_key)})
    return out


def _tool_calls(i: int, turn: dict[str, Any], content_key: str) -> list[dict[str, Any]]:
    """A ShareGPT ``function_call`` value (JSON ``{name, arguments}`` or a list of them) as OpenAI tool calls."""
    value = turn.get(content_key)
    try:
        calls = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise UserError(f'turn {i} (function_call) is not JSON {{"name": ..., "arguments": ...}}')
    out = []
    for c in calls:
        args = c.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append({"type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


def _alpaca(record: dict[str, Any], mapping: RowMapping) -> list[dict[str, Any]]:
    col = lambda key: mapping.column("alpaca", key)  # noqa: E731 (a short local alias)
    fields = {key: record.get(col(key)) for key in ("instruction", "input", "output", "system", "history")}
    for key in ("instruction", "output"):
        if not isinstance(fields[key], str):
            raise UserError(f"field {col(key)!r} is {_kind(fields[key])}, not a string")
    if not fields["output"]:
        raise UserError(f"field {col('output')!r} is empty, so the row has nothing to train on")
    messages: list[dict[str, Any]] = []
    if fields["system"] not in (None, ""):
        if not isinstance(fields["system"], str):
            raise UserError(f"field {col('system')!r} is {_kind(fields['system'])}, not a string")
        messages.append({"role": "system", "content": fields["system"]})
    history = fields["history"] or []
    if not isinstance(history, list):
        raise UserError(
            f"field {col('history')!r} is {_kind(history)}, not a list of [instruction, output] pairs"
        )
    for n, pair in enumerate(history, 1):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise UserError(f"{col('history')}[{n}] is not an [instruction, output] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = fields["instruction"]
    if fields["input"] not in (None, ""):
        if not isinstance(fields["input"], str):
            raise UserError(f"field {col('input')!r} is {_kind(fields['input'])}, not a string")
        prompt = f"{prompt}\n{fields['input']}"
    return [
        *messages,
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": fields["output"]},
    ]


def _kind(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"
