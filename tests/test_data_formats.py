"""ShareGPT, Alpaca and mapped rows render and mask exactly as their ``messages`` form does (DeepSeek-V3's
template, checked against transformers' apply_chat_template), and `data prepare` detects each format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chat_fixtures import make_tokenizer_folder
from seektrain.cli.main import main
from seektrain.data.chat_template import load_chat_template
from seektrain.data.row_formats import to_messages
from seektrain.data.row_mapping import RowMapping, parse_mapping
from seektrain.data.rows import RowEncoder
from seektrain.data.tokenizer import load_tokenizer
from seektrain.errors import UserError

SYSTEM, Q1, A1, Q2, A2 = "You are a lazy dog.", "what is two plus two?", "four", "and the fox?", "it jumps"
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2},
]
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": SYSTEM},
        {"from": "human", "value": Q1},
        {"from": "gpt", "value": A1},
        {"from": "user", "value": Q2},  # the OpenAI aliases are ShareGPT roles too
        {"from": "assistant", "value": A2},
    ]
}
SHAREGPT_TOP_SYSTEM = {"system": SYSTEM, "conversations": SHAREGPT["conversations"][1:]}
ALPACA = {"system": SYSTEM, "history": [[Q1, A1]], "instruction": "and the", "input": "fox?", "output": A2}
ALPACA_AS_MESSAGES = [*MESSAGES[:4], {"role": "assistant", "content": A2}]
ALPACA_AS_MESSAGES[3] = {"role": "user", "content": "and the\nfox?"}  # instruction, newline, input
TOOL_SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "weather in Paris?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "It is 21 degrees."},
    ]
}
TOOL_MESSAGES = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
]
MAPPED = {"conv": [{"speaker": "q", "text": Q1}, {"speaker": "a", "text": A1}]}
MAPPING = parse_mapping("messages=conv,role=speaker,content=text", "user=q,assistant=a")
MAPPED_ALPACA = {"question": "and the", "answer": A2}
ALPACA_MAPPING = parse_mapping("instruction=question,output=answer", None)

# (kind, row, mapping, the equivalent messages)
CASES = {
    "sharegpt": ("sharegpt", SHAREGPT, RowMapping(), MESSAGES),
    "sharegpt-system-column": ("sharegpt", SHAREGPT_TOP_SYSTEM, RowMapping(), MESSAGES),
    "alpaca": ("alpaca", ALPACA, RowMapping(), ALPACA_AS_MESSAGES),
    "alpaca-plain": (
        "alpaca",
        {"instruction": Q1, "input": "", "output": A1},
        RowMapping(),
        MESSAGES[1:3],
    ),
    "mapped-chat": ("chat", MAPPED, MAPPING, MESSAGES[1:3]),
    "mapped-alpaca": (
        "alpaca",
        MAPPED_ALPACA,
        ALPACA_MAPPING,
        [{"role": "user", "content": "and the"}, MESSAGES[4]],
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tokenizer_folder(tmp_path_factory.mktemp("tok") / "v3", "deepseek-v3")


@pytest.mark.parametrize("name", CASES)
def test_each_format_renders_and_masks_as_its_messages(folder, name):
    from transformers import AutoTokenizer

    kind, row, mapping, messages = CASES[name]
    template, tok = load_chat_template(folder), load_tokenizer(str(folder))
    ids, mask = RowEncoder(tok, template, mapping=mapping).encode(kind, "x:1", row)
    want_ids, want_mask = RowEncoder(tok, template).encode("chat", "x:1", {"messages": messages})
    assert (ids, mask) == (want_ids, want_mask)
    assert 0 < sum(mask) < len(mask)
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert ids == hf.apply_chat_template(messages, tokenize=True)["input_ids"]


def test_sharegpt_tool_turns_are_openai_tool_calls():
    assert to_messages("sharegpt", TOOL_SHAREGPT, RowMapping()) == TOOL_MESSAGES


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepared(out: Path) -> tuple[bytes, bytes]:
    return (out / "shard-00000.bin").read_bytes(), (out / "shard-00000.mask").read_bytes()


@pytest.mark.parametrize(
    "name, rows, extra",
    [
        ("sharegpt", [SHAREGPT, SHAREGPT_TOP_SYSTEM], []),
        ("alpaca", [{"instruction": Q1, "output": A1}], []),
        (
            "mapped",
            [MAPPED],
            ["--columns", "messages=conv,role=speaker,content=text", "--roles", "user=q,assistant=a"],
        ),
    ],
)
def test_prepare_detects_the_format(folder, tmp_path, name, rows, extra):
    """`--format auto` finds each format from the first row; the shards equal those of the messages file."""
    kinds = {"sharegpt": "sharegpt", "alpaca": "alpaca", "mapped": "chat"}
    messages = {
        "sharegpt": [MESSAGES, MESSAGES],
        "alpaca": [MESSAGES[1:3]],
        "mapped": [MESSAGES[1:3]],
    }[name]
    common = ["--tokenizer", str(folder), "--val-fraction", "0"]
    src = _jsonl(tmp_path / f"{name}.jsonl", rows)
    ref = _jsonl(tmp_path / "messages.jsonl", [{"messages": m} for m in messages])
    argv = ["data", "prepare", "--input", str(src), "--output", str(tmp_path / "a"), *common, *extra]
    assert main(argv) == 0
    assert main(["data", "prepare", "--input", str(ref), "--output", str(tmp_path / "b"), *common]) == 0
    assert _prepared(tmp_path / "a") == _prepared(tmp_path / "b")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["sources"][0]["rows"] == kinds[name]
    forced = ["data", "prepare", "--input", str(src), "--output", str(tmp_path / "c"), *common, *extra]
    assert main([*forced, "--format", kinds[name]]) == 0
    assert _prepared(tmp_path / "c") == _prepared(tmp_path / "a")
    assert np.frombuffer(_prepared(tmp_path / "a")[1], np.uint8).any()


@pytest.mark.parametrize(
    "row, match",
    [
        ({"conversations": [{"from": "gpt", "value": "x"}]}, "follows a start of the turn"),
        (
            {"conversations": [{"from": "human", "value": "x"}, {"from": "human", "value": "y"}]},
            "turn 2 .human. follows a user turn",
        ),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown role 'robot'"),
        ({"instruction": "q", "output": ""}, "'output' is empty"),
        ({"instruction": "q", "output": "a", "history": [["q"]]}, r"history\[1\]"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "no"}]},
            "function_call",
        ),
    ],
)
def test_bad_rows_say_what_is_wrong(folder, row, match):
    template, tok = load_chat_template(folder), load_tokenizer(str(folder))
    kind = "sharegpt" if "conversations" in row else "alpaca"
    with pytest.raises(UserError, match=match):
        RowEncoder(tok, template).encode(kind, "x:1", row)


@pytest.mark.parametrize(
    "columns, roles, match",
    [
        ("message=conv", None, "--columns 'message': unknown key"),
        (None, "human=user", "--roles 'human': unknown key"),
        ("messages", None, "KEY=NAME"),
        ("role=a,role=b", None, "given twice"),
    ],
)
def test_mapping_flags_are_checked(columns, roles, match):
    with pytest.raises(UserError, match=match):
        parse_mapping(columns, roles)
