"""A DeepSeek-style tokenizer folder built on the fly, and conversations to render with it.

The folder is what a released checkpoint ships (``tokenizer.json`` + ``tokenizer_config.json`` with
the chat template), only with a tiny BPE trained here, so tests need no download.
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
