"""The DeepSeek model family in plain PyTorch (dense DeepSeek-LLM, DeepSeek-V2, DeepSeek-V3).

``from_pretrained`` / ``save_pretrained`` read and write Hugging Face folders (``hf_io``). Every name
is imported on first use, so code that needs only a light submodule (``seektrain.models.hub`` for the
tokenizer of ``seektrain data``) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {
    "ModelConfig": "config",
    "RopeScaling": "config",
    "ParamCounts": "param_count",
    "count_params": "param_count",
    "OFFICIAL_PRESETS": "deepseek.presets",
    "PRESETS": "deepseek.presets",
    "get_preset": "deepseek.presets",
    "Transformer": "deepseek.transformer",
    "build_model": "registry",
    "ModelFamily": "registry",
    "get_family": "registry",
    "family_for": "registry",
    "from_pretrained": "deepseek.hf_io",
    "save_pretrained": "deepseek.hf_io",
    "pretrained_config": "deepseek.hf_io",
    "declared_config": "deepseek.hf_io",
    "with_rope_overrides": "deepseek.rope_overrides",
}

__all__ = list(_HOME)

if TYPE_CHECKING:
    from seektrain.models.config import ModelConfig, RopeScaling
    from seektrain.models.deepseek.hf_io import (
        declared_config,
        from_pretrained,
        pretrained_config,
        save_pretrained,
    )
    from seektrain.models.deepseek.presets import OFFICIAL_PRESETS, PRESETS, get_preset
    from seektrain.models.deepseek.rope_overrides import with_rope_overrides
    from seektrain.models.deepseek.transformer import Transformer
    from seektrain.models.param_count import ParamCounts, count_params
    from seektrain.models.registry import ModelFamily, build_model, family_for, get_family


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'seektrain.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"seektrain.models.{_HOME[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
