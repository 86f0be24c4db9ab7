"""Chat templates: conversations rendered to text, token ids and a per-token loss mask.

A conversation is rendered by the Jinja template of the tokenizer folder (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``) or by a named built-in one (``templates/*.jinja``, the
released DeepSeek models' templates). The environment is the one transformers' ``apply_chat_template``
builds: a sandbox (``ImmutableSandboxedEnvironment``) with ``trim_blocks``/``lstrip_blocks``, loop
controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, the special
token strings as variables, messages with their ``None`` fields dropped and ``reasoning_content``
aliased. The text is then tokenized with no specials added (the templates write ``bos_token``
themselves), so the ids are token for token what ``apply_chat_template(messages, tokenize=True)`` gives.

The loss mask comes from rendering prefixes: for assistant turn *i* the prefix is the conversation up to
*i* with the generation prompt, and the turn's text is what rendering turn *i* too adds after it; a
token is trained when its first character lies in such a span (so the turn's content and the token
that ends it, DeepSeek's ``<｜end▁of▁sentence｜>``). A template whose generation prompt is not how it
starts a turn falls back to the prefix without the prompt (the turn's header is then trained too); a
template that renders earlier turns differently once later ones follow is refused, since no prefix
then marks the turn. This is the approach of transformers' assistant masks, done by diffing renders
instead of needing ``{% generation %}`` tags in the template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from seektrain.data.tokenizer import BYTE_SPEC, ByteTokenizer, Tokenizer
from seektrain.errors import UserError

BUILTIN_TEMPLATES = ("deepseek-v3", "deepseek-llm", "deepseek-v2")
ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "last-assistant", "all")
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them
_TEMPLATES_DIR = Path(__file__).with_name("templates")


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token strings it is rendered with."""

    source: str
    origin: str  # where it came from, for messages: a file path or "built-in deepseek-v3"
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def reads_reasoning(self) -> bool:
        """Whether the template renders an assistant's reasoning field itself."""
        return any(name in self.source for name in _REASONING_FIELDS)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The text ``apply_chat_template(messages, tokenize=False, ...)`` gives; ValueError on a template error."""
        import jinja2

        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        try:
            return _compile(self.source).render(
                messages=chat,
                tools=kwargs.pop("tools", None),
                documents=kwargs.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as err:
            raise UserError(f"chat template {self.origin}: {_first_line(err)}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as err:
            raise UserError(
                f"chat template {self.origin} cannot render this conversation "
                f"({type(err).__name__}: {_first_line(err)})"
            ) from None


def load_chat_template(
    tokenizer: str | Path, builtin: str | None = None, tok: Tokenizer | None = None
) -> ChatTemplate:
    """The template for the tokenizer ``tokenizer`` names (``byte``, a folder, its ``tokenizer.json``
    or a cached hub id): ``builtin`` when given, else the folder's own; ValueError when there is none.

    ``tok`` (the loaded tokenizer) supplies the bos/eos strings when the folder has no
    ``tokenizer_config.json`` saying them.
    """
    folder = _folder_of(str(tokenizer))
    config = _read_config(folder) if folder else None
    source: str | None
    if builtin is not None:
        if builtin not in BUILTIN_TEMPLATES:
            raise UserError(f"--chat-template {builtin}: unknown; use one of {', '.join(BUILTIN_TEMPLATES)}")
        source = (_TEMPLATES_DIR / f"{builtin}.jinja").read_text(encoding="utf-8")
        origin = f"built-in {builtin}"
    else:
        source, origin = _folder_template(folder, config)
        if source is None:
            raise UserError(
                f"tokenizer {tokenizer}: no chat template (no chat_template.jinja and no chat_template "
                f"in tokenizer_config.json); pass --chat-template {'|'.join(BUILTIN_TEMPLATES)}"
            )
    return ChatTemplate(source, origin, _special_tokens(config, folder, tokenizer, tok))


def encode_conversation(
    template: ChatTemplate, tok: Tokenizer, messages: Any, train_on: str = "assistant"
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its loss mask (1 = trained), both of one length.

    ``train_on``: ``assistant`` (every assistant turn), ``last-assistant`` (only the last one) or
    ``all``. ValueError (without a file position; the caller adds it) for a malformed conversation.
    """
    if train_on not in TRAIN_ON:
        raise UserError(f"--train-on {train_on}: unknown; use one of {', '.join(TRAIN_ON)}")
    check_messages(messages)
    chat = _with_reasoning(template, messages)
    text = template.render(chat)
    for i, m in enumerate(messages):
        reasoning = m.get("reasoning_content")
        if reasoning and reasoning not in text:
            raise UserError(
                f"message {i + 1}: chat template {template.origin} drops its reasoning_content; use a "
                "template that renders it"
            )
    ids, offsets = tok.encode_chat(text)
    if train_on == "all":
        return ids, [1] * len(ids)
    turns = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
    if train_on == "last-assistant":
        turns = turns[-1:]
    spans = [_turn_span(template, chat, i, text) for i in turns]
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]
    return ids, mask


def encode_prompt(template: ChatTemplate, tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Ids of ``messages`` followed by the generation prompt: what a model is asked to continue."""
    return tok.encode_chat(template.render(_with_reasoning(template, messages), add_generation_prompt=True))[
        0
    ]


def check_messages(messages: Any) -> None:
    """ValueError naming the first problem: not a list, a non-object, an unknown role, a missing or
    non-string content, a misplaced reasoning_content, or no assistant turn at all."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"'messages' is {_kind(messages)}, not a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise UserError(f"message {i} is {_kind(m)}, not an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise UserError(f"message {i} has unknown role {role!r}; roles are {', '.join(ROLES)}")
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise UserError(f"message {i} ({role}) has no content")
        if content is not None and not isinstance(content, str):
            raise UserError(f"message {i} ({role}) has content of type {_kind(content)}; it must be a string")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            raise UserError(f"message {i} ({role}): reasoning_content must be a string on an assistant turn")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError("the conversation has no assistant turn, so nothing in it would be trained")


def _turn_span(template: ChatTemplate, chat: list[dict[str, Any]], i: int, text: str) -> tuple[int, int]:
    """Character span of assistant turn ``i`` in ``text`` (the whole conversation rendered)."""
    upto = template.render(chat[: i + 1])
    head = template.render(chat[:i], add_generation_prompt=True)
    if not upto.startswith(head):
        head = template.render(chat[:i])
    if not (upto.startswith(head) and text.startswith(upto)):
        raise UserError(
            f"chat template {template.origin} renders message {i + 1} differently once later turns "
            "follow, so its trained span cannot be found; pass --train-on all or fix the template"
        )
    return len(head), len(upto)


def _with_reasoning(template: ChatTemplate, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A template that does not read ``reasoning_content`` gets it as R1 writes it: in the content,
    ``<think>\\n…\\n</think>\\n\\n`` before the answer."""
    if template.reads_reasoning:
        return messages
    out = []
    for m in messages:
        if reasoning := m.get("reasoning_content"):
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m.get('content') or ''}"
        out.append(m)
    return out


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return (
        message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}
    )


def _folder_of(spec: str) -> Path | None:
    if spec == BYTE_SPEC:
        return None
    from seektrain.models.hub import resolve_local_path

    path = resolve_local_path(spec, "tokenizer")
    return path if path.is_dir() else path.parent


def _read_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise UserError(f"{path}: unreadable ({_first_line(err)}); fix or remove it") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: expected a JSON object, got {_kind(cfg)}; fix or remove it")
    return cfg


def _folder_template(folder: Path | None, config: dict[str, Any] | None) -> tuple[str | None, str]:
    """``chat_template.jinja`` wins over the config's ``chat_template`` (a string, or a list of named
    templates of which ``default`` is taken), as transformers loads them."""
    if folder is None:
        return None, ""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    value = (config or {}).get("chat_template")
    if isinstance(value, list):
        value = next(
            (t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None
        )
    origin = str(folder / "tokenizer_config.json")
    if value is not None and not isinstance(value, str):
        raise UserError(f"{origin}: chat_template is {_kind(value)}, not a template string")
    return value, origin


def _special_tokens(
    config: dict[str, Any] | None, folder: Path | None, spec: str | Path, tok: Tokenizer | None
) -> dict[str, str]:
    """``bos_token``, ``eos_token``... as the template sees them: from the folder's config files when it
    has them (transformers' ``special_tokens_map``), else the tokenizer's own bos/eos names."""
    if config is not None:
        extra = folder / "special_tokens_map.json" if folder else None
        more = _read_json(extra) if extra and extra.is_file() else {}
        found = {k: _token_text(config.get(k, more.get(k))) for k in SPECIAL_TOKEN_KEYS}
        return {k: v for k, v in found.items() if v is not None}
    if tok is None:
        from seektrain.data.tokenizer import load_tokenizer

        tok = load_tokenizer(str(spec))
    names = {"bos_token": tok.bos_id, "eos_token": tok.eos_id}
    if isinstance(tok, ByteTokenizer):
        names["pad_token"] = tok.pad_id
    return {k: name for k, i in names.items() if i is not None and (name := tok.token_name(i)) is not None}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise UserError(f"{path}: unreadable ({_first_line(err)}); fix or remove it") from None
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(err).__name__


_COMPILED: dict[str, Any] = {}


def _compile(source: str) -> Any:
    """The template compiled once per source, in transformers' sandboxed environment."""
    if source not in _COMPILED:
        _COMPILED[source] = _environment().from_string(source)
    return _COMPILED[source]


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask tags) render their body."""

        tags = {"generation"}  # noqa: RUF012 (jinja reads it as a class attribute)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names, as transformers' does (no reach into internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    env.globals["namespace"] = Namespace
    return env
