"""Hugging Face hub ids (``org/name``) wherever a model folder or a tokenizer is named.

A local path always wins; a spec that is not one but has the ``org/name`` form is looked up in
huggingface_hub's cache (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``). Nothing is
downloaded here: every rank of every node resolves the spec, and hundreds of processes starting the
same multi-hundred-gigabyte download is not what a training job should do. Download once with
``hf download org/name`` (or let transformers fill the cache), then train.
"""

from __future__ import annotations

import re
from pathlib import Path

from seektrain.errors import UserError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.fullmatch(spec)) and ".." not in spec


def resolve_local_path(spec: str, what: str) -> Path:
    """The local path ``spec`` names, or the cached snapshot folder when ``spec`` is a hub id.

    An existing local path wins. A spec that is neither an existing path nor of the ``org/name`` form
    comes back as it is, so the caller says what it expected there (a model folder, a tokenizer.json).
    ``what`` is the config key or option the spec came from; a hub id that cannot be resolved is a
    ValueError of one line naming it.
    """
    path = Path(spec).expanduser()
    if path.exists() or not is_hub_id(spec):
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(
            f"{what}={spec!r}: no such local path; reading it as a hub id needs huggingface_hub: "
            "pip install huggingface_hub"
        ) from None
    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, HFValidationError, a broken cache entry
        raise UserError(
            f"{what}={spec!r}: no such local path, and hub id {spec} is not in the Hugging Face "
            f"cache; download it first: hf download {spec}"
        ) from None
