"""Which model to train: a named preset (random init) or a Hugging Face folder (its weights)."""

from __future__ import annotations

import torch

from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.models.presets import get_preset


def resolve_model(cfg: JobConfig) -> tuple[ModelConfig, dict[str, torch.Tensor] | None]:
    """(model config, full fp32 state dict or None for random init)."""
    if not cfg.model.hf_path:
        return get_preset(cfg.model.preset), None
    from seektrain.models.hf_io import from_pretrained

    model = from_pretrained(cfg.model.hf_path, dtype=torch.float32)
    return model.cfg, model.state_dict()
