"""Chat and completion rows into token ids plus a loss mask, every error naming the file and the row.

* chat: ``{"messages": [...]}`` rendered by the chat template (``chat_template.py``); by default only
  the assistant turns are trained.
* completion: ``{"prompt": str, "completion": str}`` as plain text, no template:
  ``[bos] prompt completion eos`` (bos where the tokenizer has one), trained on ``completion eos``.
  Prompt and completion are tokenized apart, so the mask's edge is exact; ``--train-on all`` trains
  the prompt too.
"""

from __future__ import annotations

from typing import Any

from seektrain.data.chat_template import ChatTemplate, encode_conversation
from seektrain.data.tokenizer import Tokenizer
from seektrain.errors import UserError


class RowEncoder:
    def __init__(
        self, tokenizer: Tokenizer, template: ChatTemplate | None, train_on: str = "assistant"
    ) -> None:
        self.tokenizer, self.template, self.train_on = tokenizer, template, train_on

    def encode(self, kind: str, where: str, record: Any) -> tuple[list[int], list[int]]:
        """(ids, mask) of one row of ``kind`` chat or completion; ValueError '{where}: ...' for a bad row."""
        try:
            if kind == "chat":
                return self._chat(record)
            return self._completion(record)
        except ValueError as err:
            raise UserError(f"{where}: {err}; fix or remove the row") from None

    def _chat(self, record: Any) -> tuple[list[int], list[int]]:
        if not isinstance(record, dict) or "messages" not in record:
            raise UserError(
                'no field \'messages\' (a chat row is {"messages": [{"role": ..., "content": ...}]})'
            )
        assert self.template is not None
        return encode_conversation(self.template, self.tokenizer, record["messages"], self.train_on)

    def _completion(self, record: Any) -> tuple[list[int], list[int]]:
        if not isinstance(record, dict):
            raise UserError(
                f"a row must be an object with prompt and completion, got {type(record).__name__}"
            )
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                got = "missing" if record.get(key) is None else f"a {type(record[key]).__name__}"
                raise UserError(f"field {key!r} is {got}, not a string")
        tok = self.tokenizer
        head = ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(record["prompt"])
        tail = tok.encode(record["completion"]) + [tok.eos_id]
        return head + tail, [int(self.train_on == "all")] * len(head) + [1] * len(tail)
