"""One conversation with a trained model: render the history through the chat template, stream the
reply token by token, and split R1-style thinking (``<think>...</think>``) from the answer.

The terminal side (reading turns, printing, colours) is ``seektrain/cli/chat_cmd.py``; this module
knows nothing of terminals, so a test can hold a conversation without one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from seektrain.data.chat_template import ChatTemplate, load_chat_template
from seektrain.data.turn_end import stop_token_ids
from seektrain.errors import UserError
from seektrain.models import Transformer
from seektrain.train.generate import stream_tokens

if TYPE_CHECKING:
    from seektrain.data.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ChatModel:
    model: Transformer
    tokenizer: Tokenizer
    template: ChatTemplate
    stop_ids: list[int]
    source: str  # the checkpoint or Hugging Face folder the weights came from


@dataclass
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False  # ended at an end-of-turn token (not at --max-new-tokens)


@dataclass
class Conversation:
    chat: ChatModel
    sampling: Sampling
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    last: TurnStats = field(default_factory=TurnStats)

    def reply(self, user_text: str) -> Iterator[tuple[str, str]]:
        """Yield ("think" | "answer", text) pieces of the reply to ``user_text`` as they are generated;
        the answer (not the thinking) joins the history once the reply is complete."""
        history = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        turn = history + [{"role": "user", "content": user_text}]
        prompt = self.chat.template.render(turn, add_generation_prompt=True)
        ids = self.chat.tokenizer.encode_chat(prompt)[0]
        limit = self.chat.model.cfg.max_position_embeddings
        if len(ids) >= limit:
            raise UserError(
                f"the conversation is {len(ids)} tokens, over the model's context of {limit}; "
                "start a new one (/reset)"
            )
        self.last = stats = TurnStats(prompt_tokens=len(ids))
        decoder = IncrementalDecoder(self.chat.tokenizer)
        splitter = ThinkSplitter(thinking=prompt.rstrip().endswith(THINK_OPEN))
        start = time.perf_counter()
        for token in stream_tokens(
            self.chat.model,
            ids,
            self.sampling.max_new_tokens,
            self.sampling.temperature,
            top_p=self.sampling.top_p,
            seed=self.sampling.seed,
            stop_ids=self.chat.stop_ids,
        ):
            stats.new_tokens += 1
            if token in self.chat.stop_ids:
                stats.stopped = True
                break
            yield from splitter.feed(decoder.push(token))
        yield from splitter.feed(decoder.flush())
        yield from splitter.flush()
        stats.seconds = time.perf_counter() - start
        self.messages += [
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": splitter.answer.strip()},
        ]

    def reset(self) -> None:
        self.messages.clear()


def load_run_chat(run_dir: Path, builtin_template: str | None = None) -> ChatModel:
    """The newest checkpoint of a run, with the tokenizer and chat template it trained with (its run
    folder's ``tokenizer/``), or the named built-in template."""
    from seektrain.data.tokenizer import BYTE_SPEC, load_tokenizer
    from seektrain.data.tokenizer_files import data_template
    from seektrain.train.generate import (
        load_run_weights,
        run_manifest,
        run_tokenizer_spec,
    )

    spec = run_tokenizer_spec(run_dir)
    if builtin_template is None and spec == BYTE_SPEC:  # no files to carry a template: the data names it
        builtin_template = data_template(run_manifest(run_dir))
    tokenizer = load_tokenizer(spec)
    template = load_chat_template(spec, builtin_template, tokenizer)  # before the (long) weight load
    model, ckpt = load_run_weights(run_dir)
    return _chat_model(model, tokenizer, template, str(ckpt))


def load_hf_chat(folder: Path, builtin_template: str | None = None) -> ChatModel:
    """A Hugging Face folder (``convert --to-hf`` output, or a release) with its tokenizer and template."""
    from seektrain.data.tokenizer import load_tokenizer
    from seektrain.models import from_pretrained

    if not folder.is_dir():
        raise UserError(
            f"--hf {folder}: no such folder; name a Hugging Face model folder (`seektrain convert "
            "--from-checkpoint RUN --to-hf DIR` writes one)"
        )
    if not (folder / "tokenizer.json").is_file():
        raise UserError(
            f"--hf {folder}: no tokenizer.json; export with `seektrain convert ... --to-hf "
            f"{folder} --tokenizer TOKENIZER_DIR`"
        )
    tokenizer = load_tokenizer(str(folder))
    template = load_chat_template(str(folder), builtin_template, tokenizer)
    return _chat_model(from_pretrained(folder, what="--hf").eval(), tokenizer, template, str(folder))


def _chat_model(model: Transformer, tokenizer: Tokenizer, template: ChatTemplate, source: str) -> ChatModel:
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise UserError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{model.cfg.vocab_size}; pair the model with the tokenizer it was trained with"
        )
    return ChatModel(model, tokenizer, template, stop_token_ids(tokenizer, template), source)


class IncrementalDecoder:
    """Token ids in, new text out. Decoding every id so far and emitting the new suffix keeps
    characters whole that span several tokens (byte-level BPE); an incomplete character at the end
    (U+FFFD) waits for its next byte."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        return self._emit(self.tokenizer.decode(self.ids)) if self.ids else ""

    def _emit(self, text: str) -> str:
        new, self.sent = text[len(self.sent) :], text
        return new


class ThinkSplitter:
    """Streamed text in, ("think" | "answer", text) out. A tag split over two pieces is held back until
    it is whole; ``thinking`` starts inside a block (templates whose generation prompt opens one)."""

    def __init__(self, thinking: bool = False) -> None:
        self.thinking, self.pending, self.answer = thinking, "", ""

    def feed(self, text: str) -> Iterator[tuple[str, str]]:
        self.pending += text
        while self.pending:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            at = self.pending.find(tag)
            if at >= 0:
                yield from self._out(self.pending[:at])
                self.pending = self.pending[at + len(tag) :]
                self.thinking = not self.thinking
                continue
            keep = _partial_tag_suffix(self.pending, tag)
            yield from self._out(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            return

    def flush(self) -> Iterator[tuple[str, str]]:
        yield from self._out(self.pending)
        self.pending = ""

    def _out(self, text: str) -> Iterator[tuple[str, str]]:
        if text:
            if not self.thinking:
                self.answer += text
            yield ("think" if self.thinking else "answer", text)


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
