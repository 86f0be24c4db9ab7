"""Which model a job trains, in one place for the launcher, the workers, ``seektrain plan`` and
``seektrain flops``: a named preset (random init) or a Hugging Face folder (its config, and its weights
when training starts), with the job's YaRN overrides.

It lives next to the model config (not in ``train/``) so that every layer above ``models/`` can ask it; it
reads the job config only through its ``model`` section (the config package is a sibling layer, imported
for the annotation alone).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from seektrain.errors import ConfigError
from seektrain.models.config import ModelConfig

if TYPE_CHECKING:
    from seektrain.config.schema import JobConfig


def check_preset(cfg: JobConfig) -> None:
    """``model.preset`` names a preset, unless ``model.hf_path`` replaces it: a ConfigError of one line.
    Asked here, where the model is chosen, since the config package knows nothing of models."""
    from seektrain.models import preset_names

    if not cfg.model.hf_path and cfg.model.preset not in preset_names():
        raise ConfigError(
            f"model.preset={cfg.model.preset!r} is unknown; choose one of: {', '.join(preset_names())}"
        )


def rope_overrides(cfg: JobConfig) -> dict[str, float | int]:
    """The ``[model.rope_scaling]`` keys the job sets (-1 keeps the model's value)."""
    section = cfg.model.rope_scaling
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    return {name: value for name, value in values.items() if value != -1}


def configured_model_config(cfg: JobConfig) -> ModelConfig:
    """The model config the job asks for, without loading weights (a Hugging Face folder's config.json,
    or the preset), with the job's YaRN overrides applied."""
    from seektrain.models import get_preset, pretrained_config, with_rope_overrides

    if cfg.model.hf_path:
        base = pretrained_config(cfg.model.hf_path)
    else:
        check_preset(cfg)
        base = get_preset(cfg.model.preset)
    return with_rope_overrides(base, rope_overrides(cfg))
