"""DeepSeek-style tokenizer folders built on the fly, and conversations for them.

A folder is what a released checkpoint ships (``tokenizer.json`` + ``tokenizer_config.json`` with the
chat template), only with a tiny BPE trained here, so tests need no download. Two of them:
``make_tokenizer_folder`` (400 tokens, every DeepSeek special, DeepSeek-V3's own config fields) for
rendering templates (tests/test_data_chat.py), and ``build_chat_tokenizer`` (under 320 tokens, small
enough for the tiny presets' vocabulary) with ``write_chat_jsonl``'s conversations, for the fine-tuning
runs (tests/test_finetune_flow.py, tests/test_chat.py, tests/test_tokenizer_files.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from seektrain.data.chat_template import _TEMPLATES_DIR

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = [
    BOS,
    EOS,
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜▁pad▁｜>",
]
_CORPUS = [
    "hello world, how are you today?",
    "the quick brown fox jumps over the lazy dog",
    "User: what is two plus two?\n\nAssistant: four",
    "def main():\n    return 0\n",
    "<think>\nlet me think about it\n</think>\n\nthe answer is 4",
    '{"city": "Paris"}',
]


def builtin_template(name: str) -> str:
    return (_TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


# ------------------------------------------------------------------ the fine-tuning runs' tokenizer
TRAINING_SPECIALS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
TEMPLATE = builtin_template("deepseek-v3")  # DeepSeek-V3's released template, as the folder's own


def make_tokenizer_folder(folder: Path, template: str | None = "deepseek-v3") -> Path:
    """``folder`` with tokenizer.json (a 400-token byte-level BPE plus DeepSeek's special tokens) and a
    tokenizer_config.json carrying the named built-in (= released) template, or no template at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    # the fields of DeepSeek-V3's own tokenizer_config.json (its class name included: transformers 5 reads a
    # byte-level tokenizer.json as it is whatever the class says)
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "legacy": True,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<｜▁pad▁｜>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 16384,
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        config["chat_template"] = builtin_template(template)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8"
    )
    return folder


CONVERSATIONS = {
    "single": [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "how are you today?"},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "You are a lazy dog."},
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and the quick brown fox?"},
        {"role": "assistant", "content": "it jumps over the lazy dog"},
    ],
    "tool": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "I will look it up."},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ],
    "reasoning": [
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "the answer is 4", "reasoning_content": "let me think about it"},
    ],
}


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
        vocab_size=300, special_tokens=TRAINING_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(QUESTIONS + ANSWERS + ["be brief"] + ["one\n\n"] * 20, trainer)  # a \n\n token
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder
