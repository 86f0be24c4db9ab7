"""Chat data: rendering equals transformers' apply_chat_template token for token, the loss mask covers
exactly the assistant turns, and `data prepare`/`info`/`show`/`verify` carry the mask through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chat_fixtures import BOS, CONVERSATIONS, EOS, builtin_template, make_tokenizer_folder
from seektrain.cli.main import main
from seektrain.data import TokenDataset, read_manifest
from seektrain.data.chat_template import (
    BUILTIN_TEMPLATES,
    _with_reasoning,
    encode_conversation,
    encode_prompt,
    load_chat_template,
)
from seektrain.data.tokenizer import load_tokenizer

# A template that reads reasoning_content itself (as Qwen3- and V3.1-style templates do), and one with
# the transformers idioms DeepSeek's do not use: loop controls, tojson, raise_exception, {% generation %}.
READS_REASONING = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
IDIOMS = """{% if messages[0].role == 'system' %}
    {{ messages[0].content }}
{% endif %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}
    {{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content | tojson }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}assistant: {% endif %}"""  # noqa: E501 (a template line, kept whole)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {name: make_tokenizer_folder(root / name, name) for name in BUILTIN_TEMPLATES}
    out["none"] = make_tokenizer_folder(root / "none", None)
    for name, source in (("reads-reasoning", READS_REASONING), ("idioms", IDIOMS)):
        folder = make_tokenizer_folder(root / name, None)
        (folder / "chat_template.jinja").write_text(source, encoding="utf-8")  # transformers' own file name
        out[name] = folder
    return out


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("name", [*BUILTIN_TEMPLATES, "reads-reasoning", "idioms"])
def test_rendering_equals_apply_chat_template(folders, name):
    folder = folders[name]
    template, tok, hf = load_chat_template(folder), load_tokenizer(str(folder)), _hf(folder)
    for conv_name, conv in CONVERSATIONS.items():
        # a template that does not read reasoning_content gets it inside the content, R1's way
        messages = _with_reasoning(template, conv)
        ids, mask = encode_conversation(template, tok, conv)
        assert ids == hf.apply_chat_template(messages, tokenize=True)["input_ids"], (name, conv_name)
        assert template.render(messages) == hf.apply_chat_template(messages, tokenize=False)
        prompt = conv[:-1]
        assert (
            encode_prompt(template, tok, prompt)
            == hf.apply_chat_template(
                _with_reasoning(template, prompt), tokenize=True, add_generation_prompt=True
            )["input_ids"]
        )
        assert len(mask) == len(ids) and 0 < sum(mask) < len(ids)
        if BOS in template.render(conv):
            assert (
                ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
            )  # the template's BOS, never a second one
    assert template.reads_reasoning == (name == "reads-reasoning")


@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_builtin_template_for_a_folder_without_one(folders, name):
    folder = folders["none"]
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        load_chat_template(folder)
    template, tok, hf = load_chat_template(folder, name), load_tokenizer(str(folder)), _hf(folder)
    assert template.source == builtin_template(name)
    for conv in CONVERSATIONS.values():
        messages = _with_reasoning(template, conv)
        ids, _ = encode_conversation(template, tok, conv)
        assert (
            ids == hf.apply_chat_template(messages, chat_template=template.source, tokenize=True)["input_ids"]
        )


def test_builtin_templates_are_the_released_ones():
    """DeepSeek-LLM and DeepSeek-V2(-Lite)-Chat ship the same template; V3's marks turns with its tokens."""
    assert builtin_template("deepseek-llm") == builtin_template("deepseek-v2")
    v3 = builtin_template("deepseek-v3")
    assert (
        "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}" in v3
        and "{{bos_token}}{{ns.system_prompt}}" in v3
    )


def _trained_text(tok, ids, mask) -> list[str]:
    """The decoded runs of trained tokens."""
    runs, run = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            run.append(i)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs


def test_mask_is_exactly_the_assistant_turns(folders):
    folder = folders["deepseek-v3"]
    template, tok = load_chat_template(folder), load_tokenizer(str(folder))
    conv = CONVERSATIONS["system_multi_turn"]
    ids, mask = encode_conversation(template, tok, conv)
    assert _trained_text(tok, ids, mask) == [f"four{EOS}", f"it jumps over the lazy dog{EOS}"]
    ids, mask = encode_conversation(template, tok, conv, "last-assistant")
    assert _trained_text(tok, ids, mask) == [f"it jumps over the lazy dog{EOS}"]
    assert encode_conversation(template, tok, conv, "all")[1] == [1] * len(ids)
    ids, mask = encode_conversation(
        template, tok, CONVERSATIONS["tool"]
    )  # after tool outputs, the answer only
    assert _trained_text(tok, ids, mask) == [f"I will look it up.{EOS}", f"It is 21 degrees in Paris.{EOS}"]
    llm = load_chat_template(folders["deepseek-llm"])
    ids, mask = encode_conversation(llm, tok, conv)
    assert _trained_text(tok, ids, mask) == [f" four{EOS}", f" it jumps over the lazy dog{EOS}"]


def test_a_template_that_rewrites_history_is_refused(folders):
    """R1's template strips thinking from earlier turns, so the reasoning would silently vanish: refused."""
    r1 = builtin_template("deepseek-v3").replace(
        "{% set content = message['content'] %}",
        "{% set content = message['content'] %}{% if '</think>' in content %}{% set content = "
        "content.split('</think>')[-1] %}{% endif %}",
    )
    folder = folders["none"]
    template = load_chat_template(folder, "deepseek-v3")
    template = type(template)(r1, "r1", template.special_tokens)
    with pytest.raises(ValueError, match="drops its reasoning_content"):
        encode_conversation(template, load_tokenizer(str(folder)), CONVERSATIONS["reasoning"])
    moving = type(template)("{% for m in messages|reverse %}{{ m.content }}{% endfor %}", "reversed", {})
    with pytest.raises(ValueError, match="renders message 2 differently"):
        encode_conversation(moving, load_tokenizer(str(folder)), CONVERSATIONS["single"])


def _prepare(*argv: str) -> None:
    assert main(["data", "prepare", *argv]) == 0


def test_prepare_info_show_verify(folders, tmp_path, capsys):
    folder = folders["deepseek-v3"]
    rows = [{"messages": conv} for conv in CONVERSATIONS.values()]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "data"
    _prepare(
        "--input",
        str(tmp_path / "chat.jsonl"),
        "--output",
        str(out),
        "--tokenizer",
        str(folder),
        "--val-fraction",
        "0",
    )
    template, tok = load_chat_template(folder), load_tokenizer(str(folder))
    expected = [encode_conversation(template, tok, conv) for conv in CONVERSATIONS.values()]
    m = read_manifest(out)
    assert m.train.documents == len(rows) and m.train.tokens == sum(len(i) for i, _ in expected)
    assert m.train.trained == sum(sum(k) for _, k in expected) < m.train.tokens
    assert m.rows["train_on"] == "assistant" and m.rows["template"].endswith("tokenizer_config.json")
    capsys.readouterr()
    assert main(["data", "info", str(out)]) == 0
    assert f"{m.train.tokens:,} tokens ({m.train.trained:,} trained)" in capsys.readouterr().out
    for index, (ids, mask) in enumerate(expected):
        assert main(["data", "show", str(out), "--index", str(index), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"tokens": ids, "loss_mask": mask}
    assert main(["data", "show", str(out), "--index", "1"]) == 0
    text = capsys.readouterr().out.split("):\n", 1)[1].rstrip("\n")
    assert text == (
        f"{BOS}You are a lazy dog.<｜User｜>what is two plus two?<｜Assistant｜>⟦four{EOS}⟧<｜User｜>and the "
        f"quick brown fox?<｜Assistant｜>⟦it jumps over the lazy dog{EOS}⟧"
    )
    assert main(["data", "verify", str(out)]) == 0
    mask_file = out / "shard-00000.mask"
    data = bytearray(mask_file.read_bytes())
    data[3] ^= 1
    mask_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-00000.mask: sha256 mismatch"):
        from seektrain.data import verify_dataset

        verify_dataset(out)


def test_parquet_and_completion_rows(folders, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = folders["deepseek-v3"]
    convs = [CONVERSATIONS["single"], CONVERSATIONS["system_multi_turn"]]
    pq.write_table(pa.table({"messages": convs}), tmp_path / "chat.parquet")
    (tmp_path / "c.jsonl").write_text(json.dumps({"prompt": "two plus two is", "completion": " four"}) + "\n")
    out = tmp_path / "data"
    _prepare(
        "--input",
        str(tmp_path / "chat.parquet"),
        str(tmp_path / "c.jsonl"),
        "--output",
        str(out),
        "--tokenizer",
        str(folder),
        "--val-fraction",
        "0",
    )
    tok, template = load_tokenizer(str(folder)), load_chat_template(folder)
    ds = TokenDataset(out)
    ends = ds.document_ends().tolist()
    assert ends[:2] == np.cumsum([len(encode_conversation(template, tok, c)[0]) for c in convs]).tolist()
    start = ends[1]
    ids, mask = ds.read(start, ends[2] - start).tolist(), ds.read_mask(start, ends[2] - start).tolist()
    prompt, answer = [tok.bos_id] + tok.encode("two plus two is"), tok.encode(" four") + [tok.eos_id]
    assert ids == prompt + answer and mask == [0] * len(prompt) + [1] * len(answer)
    assert [s.get("rows") for s in read_manifest(out).sources] == ["chat", "completion"]


def test_overlong_rows_are_dropped_or_truncated_and_counted(folders, tmp_path, capsys):
    folder = folders["deepseek-v3"]
    rows = [{"messages": conv} for conv in CONVERSATIONS.values()]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    template, tok = load_chat_template(folder), load_tokenizer(str(folder))
    lengths = [len(encode_conversation(template, tok, c)[0]) for c in CONVERSATIONS.values()]
    limit = sorted(lengths)[1]  # two rows fit, two are longer
    for policy in ("drop", "truncate"):
        out = tmp_path / policy
        capsys.readouterr()
        _prepare(
            "--input",
            str(tmp_path / "chat.jsonl"),
            "--output",
            str(out),
            "--tokenizer",
            str(folder),
            "--val-fraction",
            "0",
            "--max-len",
            str(limit),
            "--overlong",
            policy,
        )
        m = read_manifest(out)
        longer = sum(n > limit for n in lengths)
        assert (m.rows["dropped"], m.rows["truncated"]) == ((longer, 0) if policy == "drop" else (0, longer))
        assert m.train.documents == len(rows) - m.rows["dropped"]
        assert np.diff(TokenDataset(out).document_ends(), prepend=0).max() <= limit
        assert f"max-len   {limit} tokens: {m.rows['dropped']} documents dropped" in capsys.readouterr().out
    # --force replaces a chat dataset (its mask and ends files are ours), and only with --force
    capsys.readouterr()
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(tmp_path / "chat.jsonl"),
                "--output",
                str(tmp_path / "drop"),
                "--tokenizer",
                str(folder),
            ]
        )
        == 2
    )
    assert "already a prepared dataset; pass --force" in capsys.readouterr().err
    _prepare(
        "--input",
        str(tmp_path / "chat.jsonl"),
        "--output",
        str(tmp_path / "drop"),
        "--tokenizer",
        str(folder),
        "--force",
        "--val-fraction",
        "0",
    )
    assert read_manifest(tmp_path / "drop").train.documents == len(rows)


def test_byte_tokenizer_with_a_builtin_template(tmp_path):
    """`--tokenizer byte` renders its <|bos|>/<|eos|> as their ids, the rest as bytes."""
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CONVERSATIONS["single"]}) + "\n")
    _prepare(
        "--input",
        str(tmp_path / "c.jsonl"),
        "--output",
        str(tmp_path / "d"),
        "--chat-template",
        "deepseek-llm",
        "--val-fraction",
        "0",
    )
    ds = TokenDataset(tmp_path / "d")
    ids, mask = ds.read(0, len(ds)).tolist(), ds.read_mask(0, len(ds)).tolist()
    answer = list(b" how are you today?") + [257]
    assert ids == [256] + list(b"User: hello world\n\nAssistant:") + answer
    assert mask == [0] * (len(ids) - len(answer)) + [1] * len(answer)
