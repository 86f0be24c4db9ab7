"""`seektrain chat` without a terminal: the reply streams in pieces that join to the decoded tokens,
thinking is kept apart from the answer (and out of the history), the history grows turn by turn, the
end-of-turn token stops a reply, nucleus sampling keeps only the likeliest tokens, and the command
answers through a pipe (`--prompt`, and lines on stdin)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from chat_fixtures import EOS, build_chat_tokenizer
from run_cli import seektrain
from seektrain.cli.chat_cmd import _answer
from seektrain.data.chat_template import load_chat_template
from seektrain.data.tokenizer import load_tokenizer
from seektrain.data.turn_end import stop_token_ids
from seektrain.train.chat import (
    ChatModel,
    Conversation,
    IncrementalDecoder,
    Sampling,
    ThinkSplitter,
)
from seektrain.train.generate import _pick, stream_tokens


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return build_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


class Scripted(torch.nn.Module):
    """A stand-in model whose greedy continuation is ``script``, one token per call, whatever it is fed;
    it records the length of the sequence so far at every call (the input's, or the cache's after the
    input), so a test sees what the model was asked."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.script, self.vocab, self.seen = script, vocab, []
        self.cfg = SimpleNamespace(max_position_embeddings=4096, vocab_size=vocab)

    def init_cache(self, batch: int, max_len: int, pads_B=None) -> SimpleNamespace:
        return SimpleNamespace(length=0, max_len=max_len)

    def forward(self, ids, cache=None):
        if cache is not None:
            cache.length += ids.shape[1]
        length = ids.shape[1] if cache is None else cache.length
        if not self.seen or length <= self.seen[-1]:  # a new reply: its prompt
            self.start = length
        self.seen.append(length)
        logits = torch.zeros(1, ids.shape[1], self.vocab)
        logits[0, -1, self.script[min(length - self.start, len(self.script) - 1)]] = 10.0
        return SimpleNamespace(logits=logits)


def _conversation(tok_dir: Path, reply: str, system: str | None = None) -> Conversation:
    tok = load_tokenizer(str(tok_dir))
    template = load_chat_template(str(tok_dir), tok=tok)
    model = Scripted(tok.encode_chat(reply)[0], tok.vocab_size)
    chat = ChatModel(model, tok, template, stop_token_ids(tok, template), "scripted")
    return Conversation(chat, Sampling(temperature=0.0, top_p=1.0, max_new_tokens=50, seed=0), system=system)


def test_thinking_streams_apart_from_the_answer_and_stays_out_of_the_history(tok_dir):
    conv = _conversation(tok_dir, f"<think>\nlet me count\n</think>\n\nfour{EOS}say hello")
    pieces = list(conv.reply("what is two plus two"))
    think = "".join(t for k, t in pieces if k == "think")
    answer = "".join(t for k, t in pieces if k == "answer")
    assert think == "\nlet me count\n" and answer == "\n\nfour"  # EOS ends the reply, nothing after it
    assert len(pieces) > 4  # streamed, not one piece at the end
    assert conv.last.stopped and conv.last.new_tokens == len(
        conv.chat.tokenizer.encode_chat(f"<think>\nlet me count\n</think>\n\nfour{EOS}")[0]
    )
    assert conv.messages == [
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
    ]


def test_history_grows_and_reset_clears_it(tok_dir):
    conv = _conversation(tok_dir, f"blue{EOS}", system="be brief")
    list(conv.reply("name a colour"))
    first = conv.last.prompt_tokens
    list(conv.reply("another one"))
    rendered = conv.chat.template.render(
        [{"role": "system", "content": "be brief"}, *conv.messages[:3]], add_generation_prompt=True
    )
    assert conv.last.prompt_tokens == len(conv.chat.tokenizer.encode_chat(rendered)[0]) > first
    conv.reset()
    list(conv.reply("name a colour"))
    assert conv.last.prompt_tokens == first


def test_a_conversation_past_the_context_is_refused_and_left_as_it_was(tok_dir):
    conv = _conversation(tok_dir, f"four{EOS}")
    conv.chat.model.cfg.max_position_embeddings = 12
    list(conv.reply("hi"))
    with pytest.raises(ValueError, match=r"the conversation is \d+ tokens, over the model's context of 12"):
        list(conv.reply("what is two plus two"))
    assert len(conv.messages) == 2


def test_the_terminal_view_marks_the_thinking_block(tok_dir, capsys):
    conv = _conversation(tok_dir, f"<think>\nhmm\n</think>\n\nfour{EOS}")
    _answer(conv, "what is two plus two", terminal=False)
    out, err = capsys.readouterr()
    assert out == "[thinking]\n\nhmm\n\n[/thinking]\n\n\nfour\n"
    assert re.fullmatch(r"# \d+ prompt tokens, \d+ generated \(\d+\.\d/s\), end of turn\n", err)


@pytest.mark.parametrize(
    "chunks", [["<th", "ink>a</thi", "nk>b"], ["<think>a</think>b"], list("<think>a</think>b")]
)
def test_think_tags_split_across_pieces(chunks):
    splitter = ThinkSplitter()
    out = [p for c in chunks for p in splitter.feed(c)] + list(splitter.flush())
    assert "".join(t for k, t in out if k == "think") == "a" and splitter.answer == "b"


def test_incremental_decoding_keeps_characters_whole(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    text = "héllo ✓ wörld"
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in tok.encode_chat(text)[0]] + [decoder.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_end_of_turn_is_eos_for_deepseek_and_the_template_marker_for_chatml(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    assert stop_token_ids(tok, load_chat_template(str(tok_dir), tok=tok)) == [tok.eos_id]
    chatml = load_chat_template(str(tok_dir), tok=tok)
    chatml = type(chatml)(
        "{% for m in messages %}<｜User｜>{{ m['content'] }}</think>\n{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
        "chatml-like",
        chatml.special_tokens,
    )
    assert stop_token_ids(tok, chatml) == [tok.eos_id, tok.encode_chat("</think>")[0][0]]
    blank = type(chatml)("{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}", "blank", {})
    assert len(tok.encode_chat("\n\n")[0]) == 1  # one token, but blank: no end marker
    assert stop_token_ids(tok, blank) == [tok.eos_id]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    drawn = {int(_pick(logits, 1.0, 0, 0.7, gen)) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 alone is below 0.7; 0.5 + 0.3 reaches it
    assert {int(_pick(logits, 1.0, 0, 0.4, gen)) for _ in range(50)} == {0}
    assert int(_pick(logits, 0.0, 0, 0.7, gen)) == 0


def test_a_stop_token_ends_the_stream():
    model = Scripted([5, 6, 7, 8], 10)
    assert list(stream_tokens(model, [1, 2], 10, temperature=0, stop_ids=[7])) == [5, 6, 7]


@pytest.fixture(scope="module")
def hf(tok_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    seektrain("convert", "--preset", "tiny-v3", "--to-hf", str(out), "--tokenizer", str(tok_dir))
    return out


def test_chat_cli_answers_a_prompt_and_stdin_turns_from_an_hf_folder(hf):
    one = seektrain(
        "chat", "--hf", str(hf), "--prompt", "say hello", "--max-new-tokens", "6", "--temperature", "0"
    )
    assert one.stderr.startswith(f"# {hf}\n") and re.search(r"# \d+ prompt tokens, \d generated", one.stderr)
    piped = seektrain(
        "chat",
        "--hf",
        str(hf),
        "--max-new-tokens",
        "3",
        "--temperature",
        "0",
        "--system",
        "be brief",
        input="say hello\n\n/reset\nsay hello\nname a colour\n/exit\nnever read\n",
    )
    prompts = [int(n) for n in re.findall(r"# (\d+) prompt tokens", piped.stderr)]
    assert len(prompts) == 3 and prompts[0] == prompts[1] < prompts[2]  # /reset, then history grows
    assert "# new conversation" in piped.stderr


def test_chat_cli_on_a_terminal_prompts_for_each_turn(hf):
    """The interactive mode on a pseudo-terminal, as a user types: a `you>` prompt per turn, the reply,
    the statistics line; /exit ends it."""
    main, side = os.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "seektrain.cli.main",
            "chat",
            "--hf",
            str(hf),
            "--max-new-tokens",
            "3",
            "--temperature",
            "0",
        ],
        stdin=side,
        stdout=side,
        stderr=side,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(side)
    seen = bytearray()

    def read_until(text: bytes, count: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while seen.count(text) < count and time.monotonic() < deadline:
            if select.select([main], [], [], 1)[0]:
                seen.extend(os.read(main, 4096))
        assert seen.count(text) >= count, seen.decode(errors="replace")

    try:
        read_until(b"you> ", 1)
        os.write(main, b"say hello\r")
        read_until(b"generated", 1)
        read_until(b"you> ", 2)
        os.write(main, b"/exit\r")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(main)
    assert re.search(rb"say hello\r?\n.*\r?\n# \d+ prompt tokens, 3 generated", bytes(seen)), bytes(seen)
