"""Chat and completion rows into token ids plus a loss mask, every error naming the file and the row.

* chat, ShareGPT, Alpaca: the row's ``messages`` (``row_formats.py``) rendered by the chat template
  (``chat_template.py``); by default only the assistant turns are trained.
* completion: ``{"prompt": str, "completion": str}`` as plain text, no template:
  ``[bos] prompt completion eos`` (bos where the tokenizer has one), trained on ``completion eos``.
  Prompt and completion are tokenized apart, so the mask's edge is exact; ``--train-on all`` trains
  the prompt too.
"""

from __future__ import annotations

from typing import Any

from seektrain.data.chat_template import ChatTemplate, encode_conversation
from seektrain.data.row_formats import CHAT_KINDS, check_fits, to_messages
from seektrain.data.row_mapping import RowMapping
from seektrain.data.tokenizer import Tokenizer
from seektrain.errors import UserError


class RowEncoder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        train_on: str = "assistant",
        mapping: RowMapping | None = None,
        text_field: str = "text",
    ) -> None:
        self.tokenizer, self.template, self.train_on = tokenizer, template, train_on
        self.mapping, self.text_field = mapping or RowMapping(), text_field

    def encode(self, kind: str, where: str, record: Any) -> tuple[list[int], list[int]]:
        """(ids, mask) of one row of a chat kind or completion; UserError '{where}: ...' for a bad row."""
        check_fits(where, kind, record, self.mapping, self.text_field)
        try:
            if kind in CHAT_KINDS:
                assert self.template is not None
                messages = to_messages(kind, record, self.mapping)
                return encode_conversation(self.template, self.tokenizer, messages, self.train_on)
            return self._completion(record)
        except ValueError as err:
            raise UserError(f"{where}: {err}; fix or remove the row") from None

    def _completion(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        text = {}
        for key in ("prompt", "completion"):
            name = self.mapping.column("completion", key)
            if not isinstance(record.get(name), str):
                got = "missing" if record.get(name) is None else f"a {type(record[name]).__name__}"
                raise UserError(f"field {name!r} is {got}, not a string")
            text[key] = record[name]
        tok = self.tokenizer
        head = ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(text["prompt"])
        tail = tok.encode(text["completion"]) + [tok.eos_id]
        return head + tail, [int(self.train_on == "all")] * len(head) + [1] * len(tail)
