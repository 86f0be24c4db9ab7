"""Which model a job trains, in one place for the launcher, the workers and ``seektrain flops``: a named
preset (random init) or a Hugging Face folder (its config, and its weights when training starts)."""

from __future__ import annotations

import torch

from seektrain.config.loader import ConfigError
from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.models.presets import PRESETS


def check_preset(cfg: JobConfig) -> None:
    """``model.preset`` names a preset, unless ``model.hf_path`` replaces it: a ConfigError of one line.
    Asked here, where the model is chosen, since the config package knows nothing of models."""
    if not cfg.model.hf_path and cfg.model.preset not in PRESETS:
        raise ConfigError(
            f"model.preset={cfg.model.preset!r} is unknown; choose one of: {', '.join(PRESETS)}"
        )


def configured_model_config(cfg: JobConfig) -> ModelConfig:
    """The model config the job asks for, without loading weights (a Hugging Face folder's config.json,
    or the preset)."""
    if cfg.model.hf_path:
        from seektrain.models.hf_io import pretrained_config

        return pretrained_config(cfg.model.hf_path)
    check_preset(cfg)
    from seektrain.models.presets import get_preset

    return get_preset(cfg.model.preset)


def initial_weights(cfg: JobConfig) -> dict[str, torch.Tensor] | None:
    """Full fp32 weights to start from: the Hugging Face folder's, or None for random init."""
    if not cfg.model.hf_path:
        return None
    from seektrain.models.hf_io import from_pretrained

    return from_pretrained(cfg.model.hf_path, dtype=torch.float32).state_dict()
