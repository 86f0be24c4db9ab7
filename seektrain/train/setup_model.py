"""Which model a job trains, in one place for the launcher, the workers and ``seektrain flops``: a named
preset (random init) or a Hugging Face folder (its config, and its weights when training starts)."""

from __future__ import annotations

import dataclasses

import torch

from seektrain.config.loader import ConfigError
from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.presets import PRESETS
from seektrain.models.deepseek.rope_overrides import with_rope_overrides


def check_preset(cfg: JobConfig) -> None:
    """``model.preset`` names a preset, unless ``model.hf_path`` replaces it: a ConfigError of one line.
    Asked here, where the model is chosen, since the config package knows nothing of models."""
    if not cfg.model.hf_path and cfg.model.preset not in PRESETS:
        raise ConfigError(
            f"model.preset={cfg.model.preset!r} is unknown; choose one of: {', '.join(PRESETS)}"
        )


def rope_overrides(cfg: JobConfig) -> dict[str, float | int]:
    """The ``[model.rope_scaling]`` keys the job sets (-1 keeps the model's value)."""
    section = cfg.model.rope_scaling
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    return {name: value for name, value in values.items() if value != -1}


def configured_model_config(cfg: JobConfig) -> ModelConfig:
    """The model config the job asks for, without loading weights (a Hugging Face folder's config.json,
    or the preset), with the job's YaRN overrides applied."""
    if cfg.model.hf_path:
        from seektrain.models.deepseek.hf_io import pretrained_config

        base = pretrained_config(cfg.model.hf_path)
    else:
        check_preset(cfg)
        from seektrain.models.deepseek.presets import get_preset

        base = get_preset(cfg.model.preset)
    return with_rope_overrides(base, rope_overrides(cfg))


def initial_weights(cfg: JobConfig) -> dict[str, torch.Tensor] | None:
    """Full fp32 weights to start from: the Hugging Face folder's, or None for random init."""
    if not cfg.model.hf_path:
        return None
    from seektrain.models.deepseek.hf_io import from_pretrained

    return from_pretrained(cfg.model.hf_path, dtype=torch.float32).state_dict()
