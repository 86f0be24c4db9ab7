"""The files of a Hugging Face tokenizer, copied where a model goes: into the run folder when training
starts, and into the folder ``convert --to-hf`` writes.

Why a copy: the dataset's manifest records the tokenizer by the path it was prepared with, which may
be gone (or hold another tokenizer) by the time someone chats with the run or exports it. The run
folder's ``tokenizer/`` keeps the tokenizer and its chat template with the weights they belong to.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from seektrain.data.chat_template import load_chat_template
from seektrain.data.tokenizer import BYTE_SPEC
from seektrain.models.hub import resolve_local_path

RUN_TOKENIZER_DIR = "tokenizer"  # inside a run folder
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_BUILTIN = "built-in "  # how a manifest's rows.template names a built-in template (chat_template.py)


def tokenizer_folder(spec: str) -> Path | None:
    """The folder holding the ``tokenizer.json`` that ``spec`` names; None for the byte tokenizer."""
    if spec == BYTE_SPEC:
        return None
    path = resolve_local_path(spec, "tokenizer")
    return path if path.is_dir() else path.parent


def data_template(manifest) -> str | None:
    """The name of the built-in template a prepared dataset was rendered with (``--chat-template``),
    None when it used its tokenizer folder's own template or is plain text."""
    origin = (manifest.rows or {}).get("template") or ""
    return origin.removeprefix(_BUILTIN) if origin.startswith(_BUILTIN) else None


def write_tokenizer_files(source: Path, dest: Path, chat_template: str | None = None) -> list[str]:
    """Copy the tokenizer files of folder ``source`` into folder ``dest`` (which exists); returns the
    names written. ``chat_template`` (the text of the built-in template the data was rendered with)
    replaces the folder's own in the copied ``tokenizer_config.json``, so the copy renders as the
    training data did."""
    written = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
            written.append(name)
    if chat_template is not None:
        (dest / "chat_template.jinja").unlink(missing_ok=True)  # it would win over the config's
        path = dest / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if config.get("chat_template") != chat_template:
            config["chat_template"] = chat_template
            path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            written += [] if "tokenizer_config.json" in written else ["tokenizer_config.json"]
    return written


def copy_to_run(manifest, run_dir: Path) -> str:
    """``run_dir/tokenizer/`` with the files of the tokenizer ``manifest`` (a prepared dataset's) was
    made with, swapped in whole (a reader never sees half a folder). Returns what was done, for the log:
    the byte tokenizer needs no files, and a tokenizer that is gone or changed since the data was
    prepared is not copied (training does not need it; chat and convert then say what is missing)."""
    from seektrain.checkpoint.atomic import write_swapped

    spec = manifest.tokenizer.spec
    try:
        source = tokenizer_folder(spec)
    except ValueError as err:
        return f"tokenizer not copied into the run folder: {err}"
    if source is None:
        return "the byte tokenizer needs no files in the run folder"
    tokenizer_json = source / "tokenizer.json"
    if not tokenizer_json.is_file() or _sha256(tokenizer_json) != manifest.tokenizer.fingerprint:
        return (
            f"tokenizer not copied into the run folder: {tokenizer_json} is not the tokenizer.json the data "
            "was prepared with (missing or changed since)"
        )
    dest = run_dir / RUN_TOKENIZER_DIR
    builtin = data_template(manifest)
    template = load_chat_template(spec, builtin).source if builtin else None
    write_swapped(dest, lambda tmp: write_tokenizer_files(source, tmp, template))
    return f"tokenizer {spec} copied to {dest}"


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
