"""A tokenizer folder with a chat template, small enough for the tiny presets (vocab 320), and a chat
JSONL file, for the fine-tuning tests (tests/test_finetune_flow.py, tests/test_chat.py,
tests/test_tokenizer_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
# DeepSeek-V3's released template (the built-in copy chat_template.py ships), as the folder's own.
TEMPLATE = (Path(__file__).resolve().parent.parent / "seektrain/data/templates/deepseek-v3.jinja").read_text()
QUESTIONS = [
    "what is two plus two",
    "name a colour",
    "say hello",
    "what is the capital of france",
    "count to three",
    "what do cats say",
]
ANSWERS = ["four", "blue", "hello there", "paris", "one two three", "meow"]


def conversations(n: int = 48) -> list[dict]:
    rows = []
    for i in range(n):
        q, a = QUESTIONS[i % len(QUESTIONS)], ANSWERS[i % len(ANSWERS)]
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if i % 3 == 0:
            messages = [{"role": "system", "content": "be brief"}] + messages
        if i % 4 == 0:
            j = (i + 1) % len(QUESTIONS)
            messages += [
                {"role": "user", "content": QUESTIONS[j]},
                {"role": "assistant", "content": ANSWERS[j]},
            ]
        rows.append({"messages": messages})
    return rows


def write_chat_jsonl(path: Path, n: int = 48) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in conversations(n)))
    return path


def build_chat_tokenizer(folder: Path, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE (256 bytes, the DeepSeek specials, a few merges: under 320 tokens) trained on
    the conversations, saved as a Hugging Face tokenizer folder with ``template`` in its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(QUESTIONS + ANSWERS + ["be brief"] + ["one\n\n"] * 20, trainer)  # a \n\n token
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder
