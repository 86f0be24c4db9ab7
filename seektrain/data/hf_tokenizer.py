"""The tokenizer half of a Hugging Face folder that ``convert --to-hf`` writes: ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``generation_config.json``.

Why: weights alone do not make a model someone can talk to. With these three files the folder loads
in transformers (``AutoModelForCausalLM`` + ``AutoTokenizer``), renders the same prompts the training
data was rendered with, and ``generate`` stops where a turn ends.
"""

from __future__ import annotations

import json
from pathlib import Path

from seektrain.data.chat_template import load_chat_template
from seektrain.data.tokenizer import load_tokenizer
from seektrain.data.tokenizer_files import write_tokenizer_files
from seektrain.data.turn_end import stop_token_ids
from seektrain.errors import UserError

GENERATION_CONFIG = "generation_config.json"
# The sampling defaults DeepSeek ships in the generation_config.json of its V3 and R1 releases; `seektrain
# chat` starts from the same values.
TEMPERATURE = 0.6
TOP_P = 0.95


def write_hf_tokenizer(source: Path, dest: Path, vocab_size: int) -> list[str]:
    """Copy tokenizer folder ``source`` into the model folder ``dest`` and write its generation config;
    returns the file names written. Refuses a tokenizer with more tokens than the model has rows."""
    tokenizer = load_tokenizer(str(source))
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"tokenizer {source} has {tokenizer.vocab_size} tokens but the model has vocab_size "
            f"{vocab_size}; pass the tokenizer the model was trained with (--tokenizer)"
        )
    written = write_tokenizer_files(source, dest)
    _complete_tokenizer_config(dest / "tokenizer_config.json", tokenizer)
    if "tokenizer_config.json" not in written:
        written.append("tokenizer_config.json")
    try:
        template = load_chat_template(str(dest), tok=tokenizer)
    except ValueError:  # no template: a tokenizer for plain text, whose turns end at EOS
        template = None
    stop = stop_token_ids(tokenizer, template)
    generation = {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": stop[0] if len(stop) == 1 else stop,
        "do_sample": True,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
    }
    (dest / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    return [*written, GENERATION_CONFIG]


def _complete_tokenizer_config(path: Path, tokenizer) -> None:
    """Name the fast tokenizer class and the bos/eos tokens when the source's config leaves them out
    (a bare tokenizer.json): transformers then loads tokenizer.json as it is, with the same specials."""
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("eos_token", tokenizer.decode([tokenizer.eos_id]))
    if tokenizer.bos_id is not None:
        config.setdefault("bos_token", tokenizer.decode([tokenizer.bos_id]))
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
