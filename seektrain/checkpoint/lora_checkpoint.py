"""LoRA checkpoints: the ``"lora"`` record of ``trainer_state.json``, the checks before resuming one, and
reading one back as a whole model (base + adapters) for ``seektrain convert``.

A LoRA checkpoint's DCP shards hold the adapters and their AdamW state (``CheckpointManager`` with
``adapters_only``); the trainer state is the same as a full checkpoint's, plus::

    "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": [...],
             "base_dtype": "bfloat16", "base": {...}}

``base`` says which frozen base the adapters belong to (lora_base.py: a Hugging Face folder and its
fingerprint, or a preset and its seed); ``base_dtype`` is the dtype training held it in (the compute
dtype), so that an export rebuilds the very weights the adapters were trained on.

Resuming compares the record with the run's own before any weight is read, and refuses in one line:
LoRA on a full or weights-only checkpoint, a LoRA checkpoint without ``lora.enabled``, other ``[lora]``
settings, or another base. DCP reshards the adapters and their optimizer state like any other tensors,
so a checkpoint of one layout resumes under another.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from seektrain.checkpoint.finder import read_trainer_state
from seektrain.checkpoint.lora_base import base_reference, check_same_base, saved_base_folder
from seektrain.checkpoint.manager import describe_error
from seektrain.config.dtypes import dtype_from_name
from seektrain.config.schema import JobConfig
from seektrain.errors import UserError
from seektrain.models import build_model
from seektrain.models.config import ModelConfig
from seektrain.models.lora import LoraSpec, add_adapters, freeze_base, is_adapter

LORA = "lora"  # the trainer_state.json key
SETTINGS = ("rank", "alpha", "dropout", "target_modules")


def lora_record(job: JobConfig, model: ModelConfig, compute_dtype: torch.dtype) -> dict | None:
    """The ``"lora"`` record of this run's checkpoints; None without ``lora.enabled``."""
    if not job.lora.enabled:
        return None
    lo = job.lora
    return {
        "rank": lo.rank,
        "alpha": lo.alpha,
        "dropout": lo.dropout,
        "target_modules": list(lo.target_modules),
        "base_dtype": str(compute_dtype).removeprefix("torch."),
        "base": base_reference(job.model.hf_path, job.model.preset, job.train.seed, model),
    }


def check_lora_resume(ckpt: Path, job: JobConfig, model: ModelConfig) -> None:
    """One ``UserError`` line unless this job may resume ``ckpt`` as far as LoRA goes (module doc)."""
    state = read_trainer_state(ckpt)
    saved = state.get(LORA)
    if not job.lora.enabled:
        if saved is not None:
            raise UserError(
                f"checkpoint {ckpt} holds LoRA adapters and no base weights: set lora.enabled=true "
                f"with its [lora] settings to resume it, or export it (seektrain convert "
                f"--from-checkpoint {ckpt} --merge-lora --to-hf OUT)"
            )
        return
    if not isinstance(saved, dict):
        kind = "a weights-only checkpoint" if state.get("weights_only") else "a full training checkpoint"
        raise UserError(
            f"checkpoint {ckpt} is {kind} and lora.enabled=true resumes only LoRA checkpoints: to train "
            f"adapters on its weights, export them (seektrain convert --from-checkpoint {ckpt} --to-hf "
            "DIR) and set model.hf_path=DIR in a new run.dir"
        )
    lo = job.lora
    for key in SETTINGS:
        want = list(lo.target_modules) if key == "target_modules" else getattr(lo, key)
        if saved.get(key) != want:
            raise UserError(
                f"checkpoint {ckpt} holds adapters trained with lora.{key}={saved.get(key)!r} but the "
                f"config asks for lora.{key}={want!r}: set it back, or checkpoint.resume=never to start fresh"
            )
    check_same_base(
        ckpt,
        base_record(saved),
        base_reference(job.model.hf_path, job.model.preset, job.train.seed, model),
        "set model.hf_path (or model.preset and train.seed) to the base it was trained on, or "
        "checkpoint.resume=never to start fresh",
    )


def lora_settings(ckpt: Path) -> dict | None:
    """The ``"lora"`` record of checkpoint ``ckpt``; None for a full checkpoint."""
    saved = read_trainer_state(ckpt).get(LORA)
    return saved if isinstance(saved, dict) else None


def base_record(saved: dict) -> dict:
    """The ``"base"`` part of a LoRA record: what the adapters were trained over ({} when absent)."""
    base = saved.get("base")
    return base if isinstance(base, dict) else {}


def spec_of(saved: dict) -> LoraSpec:
    return LoraSpec.from_values(saved["rank"], saved["alpha"], saved["dropout"], saved["target_modules"])


def load_lora_model(ckpt: Path, cfg: ModelConfig, saved: dict, base_dir: str | None = None) -> nn.Module:
    """The model LoRA checkpoint ``ckpt`` trained: its base rebuilt (a Hugging Face folder, checked
    against the recorded fingerprint, or the preset's seeded init), held in the training dtype, with the
    checkpoint's adapters (fp32) attached. ``base_dir``: a copy of the base folder elsewhere."""
    base = base_record(saved)
    model: nn.Module
    if base.get("kind") == "hf":
        from seektrain.models import from_pretrained

        folder = saved_base_folder(ckpt, base, base_dir)
        model = from_pretrained(folder, dtype=torch.float32, what="--base")
    else:
        model = build_model(cfg, seed=int(base.get("seed", 0)))
    add_adapters(model, spec_of(saved))
    freeze_base(model, dtype_from_name(str(saved.get("base_dtype", "float32"))))
    state = {k: v for k, v in model.state_dict().items() if is_adapter(k)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise UserError(
            f"checkpoint {ckpt} does not hold the adapters its trainer_state.json describes "
            f"({describe_error(err)}); pick another checkpoint"
        ) from None
    model.load_state_dict(state, strict=False)
    return model.eval()
