"""Byte tokenizer and Hugging Face tokenizer.json behind the same interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from seektrain.data.tokenizer import ByteTokenizer, load_tokenizer


def build_tiny_tokenizer(path: Path) -> Path:
    """Train a tiny BPE with the `tokenizers` library and save it as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["hello world", "the quick brown fox", "def main():\n    return 0\n"] * 20, trainer
    )
    tok.save(str(path))
    return path


def test_byte_roundtrip_and_specials() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (259, 256, 257)
    text = "héllo ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode([104, 105, 257]) == "hi<|eos|>"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a character cut in half decodes with replacement
    assert tok.encode_batch(["a", "b"]) == [[97], [98]]


def test_hf_tokenizer(tmp_path: Path) -> None:
    path = build_tiny_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(path))
    assert tok.eos_id == 2 and tok.bos_id == 1
    assert tok.vocab_size <= 300 and tok.spec == str(path.resolve())
    ids = tok.encode("hello world")
    assert len(ids) < len("hello world") and tok.decode(ids) == "hello world"
    assert tok.encode_batch(["hello world"]) == [ids]
    assert load_tokenizer(str(tmp_path)).fingerprint == tok.fingerprint  # a directory holding tokenizer.json
    assert tok.fingerprint != load_tokenizer("byte").fingerprint


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(str(bad))
