"""The frozen base of a LoRA run: what a LoRA checkpoint records of it, and the checks on resume and export.

A LoRA checkpoint holds the adapters, their optimizer state and the trainer state, never the base
(for V3 that would be 1.3 TB copied into every checkpoint to save a few hundred MB of adapters). So the
checkpoint must say which base its adapters belong to, and resuming (or exporting) with another base
must be refused: adapters trained on one set of weights are noise on another, and nothing would fail.
``trainer_state.json`` gets a ``"lora"`` record::

    {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": [...],
     "base": {"kind": "hf", "path": "/models/DeepSeek-V3", "fingerprint": "<sha256>"}}
    ... or "base": {"kind": "preset", "preset": "tiny-v3", "seed": 1234, "fingerprint": "<sha256>"}

Only the fingerprints are compared: the same base read from another folder (a copy on another machine)
is the same base, and the path is there to tell the user where it was.

What a Hugging Face folder's fingerprint covers, and why not everything: a full hash of V3's 1.3 TB
reads for hours, on every resume. ``hf_fingerprint`` hashes the model config that ``config.json``
builds (not its bytes: a re-save that only reformats it is the same model), the index, and for every
``.safetensors`` file its name, size and header (every tensor's name, dtype, shape and offsets) plus
16 samples of 4 KiB spread evenly over its data: 10.2 MiB of samples for V3's 163 files. Headers
catch another architecture, dtype or sharding; the samples catch another release or fine-tune of the
same architecture, since training changes essentially every byte of every tensor. A change confined
to a few bytes between the samples goes unseen: the price of not reading 1.3 TB.

A preset base (random init) is a function of the model config and ``train.seed`` (models/deepseek/init.py's
seeding is layout-independent), so those two are its fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 4096


def _config_digest(cfg: ModelConfig) -> bytes:
    """The model a config builds, without its label (two names for one model are one model)."""
    fields = {k: v for k, v in cfg.to_dict().items() if k != "name"}
    return json.dumps(fields, sort_keys=True).encode()


def _safetensors_digest(path: Path, h) -> None:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(f"{path.name}\0{size}\0".encode() + head + fh.read(min(header_len, size)))
        start = 8 + header_len
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES_PER_FILE):
            fh.seek(start + span * i // (SAMPLES_PER_FILE - 1))
            h.update(fh.read(SAMPLE_BYTES))


def hf_fingerprint(folder: str | os.PathLike, what: str = "model.hf_path") -> str:
    """sha256 over the model config.json builds, the index and every safetensors file's name, size,
    header and 16 sampled 4 KiB blocks (module doc: why not the whole file)."""
    from seektrain.models import config_from_hf, read_config_json

    folder = Path(folder)
    cfg = config_from_hf(read_config_json(folder, what), where=str(folder / "config.json"))
    h = hashlib.sha256(_config_digest(cfg))
    try:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            h.update(json.dumps(json.loads(index.read_text()).get("weight_map"), sort_keys=True).encode())
        for path in sorted(folder.glob("*.safetensors")):
            _safetensors_digest(path, h)
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"{folder}: cannot read its weight files ({err}); check the model folder") from None
    return h.hexdigest()


def preset_fingerprint(cfg: ModelConfig, seed: int) -> str:
    return hashlib.sha256(_config_digest(cfg) + f"\0seed={seed}".encode()).hexdigest()


def base_reference(hf_path: str, preset: str, seed: int, cfg: ModelConfig) -> dict:
    """The ``"base"`` record of a LoRA run whose base is ``model.hf_path`` (when set) or ``model.preset``
    initialised with ``train.seed``; ``cfg`` is the model that base builds."""
    if hf_path:
        from seektrain.models.hub import resolve_local_path

        folder = resolve_local_path(hf_path, "model.hf_path").resolve()
        return {"kind": "hf", "path": str(folder), "fingerprint": hf_fingerprint(folder)}
    return {"kind": "preset", "preset": preset, "seed": seed, "fingerprint": preset_fingerprint(cfg, seed)}


def describe_base(base: dict) -> str:
    fp = str(base.get("fingerprint", ""))[:12]
    if base.get("kind") == "hf":
        return f"the Hugging Face folder {base.get('path')} (fingerprint {fp})"
    return f"preset {base.get('preset')} initialised with train.seed={base.get('seed')} (fingerprint {fp})"


def check_same_base(ckpt: Path, saved: dict, current: dict, fix: str) -> None:
    """One line naming both bases when the adapters of ``ckpt`` were trained on another base."""
    if saved.get("fingerprint") != current.get("fingerprint"):
        raise UserError(
            f"checkpoint {ckpt} holds LoRA adapters trained on {describe_base(saved)}, but this base is "
            f"{describe_base(current)}: {fix}"
        )


def saved_base_folder(ckpt: Path, base: dict, override: str | None) -> Path:
    """The Hugging Face folder to read the base of ``ckpt`` from for an export: ``override`` (a copy
    elsewhere) or the recorded path, once its fingerprint matches the recorded one."""
    folder = Path(override or base.get("path") or "").expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(
            f"checkpoint {ckpt} holds LoRA adapters of the base {base.get('path')}, which is not a "
            "Hugging Face folder here; pass --base HF_DIR with a copy of it"
        )
    check_same_base(
        ckpt,
        base,
        {"kind": "hf", "path": str(folder), "fingerprint": hf_fingerprint(folder, "--base")},
        "pass --base HF_DIR with the folder it was trained on",
    )
    return folder
