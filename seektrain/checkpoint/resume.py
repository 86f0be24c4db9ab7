"""The trainer's side of resuming: which model a run dir holds, and restoring the small pieces of
state that live in ``trainer_state.json`` rather than in the DCP shards.

Why a run dir's own model config wins over ``model.preset``: a checkpoint only loads into the model it
was written for, and ``seektrain convert --from-hf HF_DIR --to-checkpoint RUN_DIR`` creates run dirs
whose model is not a preset at all. So once ``run.dir`` holds a checkpoint, ``run.dir/model_config.json``
defines the model (with a warning when the config asks for something else).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from seektrain.models.config import ModelConfig

log = logging.getLogger("seektrain.checkpoint")
MODEL_CONFIG = "model_config.json"  # the same file name the trainer writes


def run_model_config(run_dir: Path, resolved: ModelConfig) -> ModelConfig:
    """The model of a run dir that holds a checkpoint (``resolved`` when it records none)."""
    path = Path(run_dir) / MODEL_CONFIG
    if not path.is_file():
        return resolved
    saved = ModelConfig.from_dict(json.loads(path.read_text()))
    if saved.to_dict() != resolved.to_dict():
        log.warning("run.dir %s holds checkpoints of model %r: resuming with it (the configured model %r "
                    "is ignored; use a new run.dir to train another model)", run_dir, saved.name, resolved.name)
    return saved


def restore_trainer_state(state: dict, scheduler, scaler, loader, loss_guard=None) -> int:
    """Apply ``trainer_state.json`` of a checkpoint; returns the step to continue after.

    A weights-only checkpoint (converted from Hugging Face) carries no training state: the scheduler,
    loss scaler and data position start fresh at step 0."""
    if state.get("weights_only"):
        return int(state.get("step", 0))
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    loader.load_state_dict(state["data"])
    if loss_guard is not None:
        loss_guard.load_state_dict(state.get("faults", {}))
    return int(state["step"])

