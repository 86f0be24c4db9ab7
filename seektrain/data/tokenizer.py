"""Tokenizers behind one small interface: the built-in byte tokenizer and Hugging Face ``tokenizer.json``.

The byte tokenizer exists so that a fresh machine can train without downloading anything; a
``tokenizer.json`` (for instance the DeepSeek one) is what real runs use. Both expose a ``spec`` (what
the user typed, recorded in manifests) and a ``fingerprint`` (a hash of the tokenizer itself) so that a
prepared dataset can be matched against the tokenizer a model is trained or sampled with.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Protocol

from seektrain.errors import UserError
from seektrain.models.hub import is_hub_id, resolve_local_path

BYTE_SPEC = "byte"

# Special tokens looked for, in order, when a tokenizer.json carries no tokenizer_config.json beside it.
_EOS_CANDIDATES = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "<|eos|>", "</s>", "<eos>", "<|end_of_text|>")
_BOS_CANDIDATES = ("<｜begin▁of▁sentence｜>", "<|bos|>", "<s>", "<bos>", "<|begin_of_text|>")


class Tokenizer(Protocol):
    spec: str
    path: Path | None
    fingerprint: str
    vocab_size: int

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def token_name(self, token_id: int) -> str | None: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; three specials follow. No training, no files, works everywhere."""

    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")

    def __init__(self) -> None:
        self.spec = BYTE_SPEC
        self.path: Path | None = None  # no file: the chat template, if any, is a built-in one
        self.fingerprint = hashlib.sha256(b"seektrain-byte-tokenizer-v1").hexdigest()
        self.bos_id = 256
        self.eos_id = 257
        self.pad_id = 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of a rendered conversation and each token's (start, end) character span in ``text``.

        Unlike ``encode``, the special names (``<|bos|>``...) written by a chat template become their
        ids, as a Hugging Face tokenizer matches its added tokens; a byte's span is its character's.
        """
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for piece in re.split("(" + "|".join(map(re.escape, self.SPECIALS)) + ")", text):
            if piece in self.SPECIALS:
                ids.append(256 + self.SPECIALS.index(piece))
                spans.append((pos, pos + len(piece)))
            else:
                for i, ch in enumerate(piece):
                    b = ch.encode("utf-8")
                    ids.extend(b)
                    spans.extend([(pos + i, pos + i + 1)] * len(b))
            pos += len(piece)
        return ids, spans

    def token_name(self, token_id: int) -> str | None:
        return self.SPECIALS[token_id - 256] if 256 <= token_id < 259 else None

    def decode(self, ids: list[int]) -> str:
        """Bytes decode with errors="replace" (a sampled sequence may cut a character in half)."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(self.SPECIALS[i - 256] if 256 <= i < 259 else "\ufffd")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``; ``encode_batch`` runs on the library's own Rust threads."""

    eos_id: int  # found in __init__, which refuses a tokenizer without one

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError:  # pragma: no cover - tokenizers is a hard dependency
            raise UserError(
                "reading tokenizer.json needs the `tokenizers` package; pip install tokenizers"
            ) from None
        try:
            self._tok = _RustTokenizer.from_file(str(path))
        except Exception as e:
            raise UserError(
                f"tokenizer={path}: not a valid tokenizer.json ({str(e).splitlines()[0]})"
            ) from None
        self.spec = str(path)
        self.path: Path | None = path  # the tokenizer.json, whose folder may hold the chat template
        self.fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._config_path = path.with_name("tokenizer_config.json")
        eos, bos = _configured_specials(path)
        self.eos_id = self._find(eos, _EOS_CANDIDATES)  # type: ignore[assignment]
        self.bos_id = self._find(bos, _BOS_CANDIDATES)
        if self.eos_id is None:
            raise UserError(
                f"tokenizer={path}: no end-of-sequence token found; add one of {', '.join(_EOS_CANDIDATES[1:4])} "
                "as a special token or set eos_token in a tokenizer_config.json beside it"
            )

    def _find(self, configured: str | None, candidates: tuple[str, ...]) -> int | None:
        if configured and self._tok.token_to_id(configured) is None:  # a typo must not pick another token
            raise UserError(
                f"{self._config_path}: token {configured!r} is not in the vocabulary of "
                f"{self._config_path.with_name('tokenizer.json')}; fix the token name"
            )
        for name in ((configured,) if configured else ()) + candidates:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character spans, exactly as transformers tokenizes a rendered chat (no specials added)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [(start, end) for start, end in enc.offsets]

    def token_name(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))


def _configured_specials(path: Path) -> tuple[str | None, str | None]:
    """eos/bos names from a ``tokenizer_config.json`` next to the file, as HF checkpoints ship them."""
    cfg_path = path.with_name("tokenizer_config.json")
    if not cfg_path.is_file():
        return None, None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise UserError(
            f"{cfg_path}: unreadable ({str(err).splitlines()[0][:200]}); fix it or remove it (eos/bos "
            "are then found in tokenizer.json)"
        ) from None
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}; fix it or remove it")

    def name(v: object) -> str | None:
        if isinstance(v, dict):
            v = v.get("content")
        return v if isinstance(v, str) else None

    return name(cfg.get("eos_token")), name(cfg.get("bos_token"))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"``, a path to a ``tokenizer.json`` (or to a directory holding one), or a hub id
    (``org/name``) in the local Hugging Face cache. ``spec`` stays what the user typed."""
    if spec == BYTE_SPEC:
        return ByteTokenizer()
    path = resolve_local_path(spec, "tokenizer")
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"tokenizer={spec}: not 'byte' and no such tokenizer.json; pass --tokenizer byte, a path to "
            "tokenizer.json or a cached hub id org/name"
        )
    tokenizer = HFTokenizer(path.resolve())
    if is_hub_id(spec) and not Path(spec).expanduser().exists():
        tokenizer.spec = spec  # the hub id, not this machine's cache path, goes into manifests
    return tokenizer
