"""Where ``convert --to-hf`` may write: a new or empty folder, or one holding only a Hugging Face model
we could have written (config.json + safetensors [+ index], and the tokenizer files and generation config
``data/hf_tokenizer.py`` adds). The same model there is replaced (a
re-export); a different model only with ``--force``; a folder holding anything else, or the model being
read, never. The new folder is written beside the old one and swapped in by rename, so a write that
fails midway (disk full) leaves the old folder as it was.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from seektrain.errors import UserError

_HF_FILES = re.compile(
    r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
    r"generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|"
    r"chat_template\.jinja"
)  # the tokenizer half: data/hf_tokenizer.py
# config.json fields that name the model (not its dtype or library versions)
_IDENTITY = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "n_routed_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "moe_intermediate_size",
)


def check_target(out: Path, new_config: dict | None, force: bool, sources: tuple[Path, ...] = ()) -> None:
    """Raise ValueError (one line) unless writing ``new_config``'s model to ``out`` loses nothing;
    ``new_config=None`` checks all but which model is there (before a long load of the source)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--to-hf {out}: is a file; choose a folder")
    for src in sources:
        if out.resolve() == src.resolve():
            raise UserError(f"--to-hf {out}: is the folder being read; write to a new folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    foreign = sorted(p.name for p in out.iterdir() if not (p.is_file() and _HF_FILES.fullmatch(p.name)))
    if foreign:
        raise UserError(
            f"--to-hf {out}: holds {foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
            "which convert does not write, so it will not replace this folder (not even with --force); "
            "choose a new folder"
        )
    if force or new_config is None:
        return
    try:
        old = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        old = None
    if not isinstance(old, dict) or any(old.get(k) != new_config.get(k) for k in _IDENTITY):
        what = (
            f"a different model ({_describe(old)})"
            if isinstance(old, dict)
            else "weights without a readable config.json"
        )
        raise UserError(
            f"--to-hf {out}: already holds {what}; pass --force to replace it, or choose a new folder"
        )


def _describe(cfg: dict) -> str:
    arch = (cfg.get("architectures") or ["?"])[0] if isinstance(cfg.get("architectures"), list) else "?"
    return f"{arch}, hidden_size {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers"
