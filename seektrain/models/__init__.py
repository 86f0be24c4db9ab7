"""The DeepSeek model family in plain PyTorch (dense DeepSeek-LLM, DeepSeek-V2, DeepSeek-V3).

``from_pretrained`` / ``save_pretrained`` read and write Hugging Face folders (``hf_io``). This package
and ``models/registry.py`` are the family's public face: code outside ``models/deepseek/`` imports its
names from here (an import-linter contract, ``pyproject.toml``), never a module of the folder. Every name
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
    "get_preset": "registry",
    "preset_names": "registry",
    "register_family": "registry",
    "Transformer": "deepseek.transformer",
    "build_model": "registry",
    "ModelFamily": "registry",
    "get_family": "registry",
    "family_for": "registry",
    "config_of": "registry",
    "from_pretrained": "deepseek.hf_io",
    "save_pretrained": "deepseek.hf_io",
    "pretrained_config": "deepseek.hf_io",
    "declared_config": "deepseek.hf_io",
    "with_rope_overrides": "deepseek.rope_overrides",
    "export_release": "deepseek.hf_export",
    "open_hf_source": "deepseek.hf_io",
    "config_from_hf": "deepseek.hf_config",
    "read_config_json": "deepseek.hf_config",
    "config_to_hf": "deepseek.hf_config",
    "check_target": "deepseek.hf_replace",
    "COLWISE": "deepseek.shapes",
    "EMBEDDING": "deepseek.shapes",
    "EXPERTS": "deepseek.shapes",
    "LINEAR": "deepseek.shapes",
    "NORM": "deepseek.shapes",
    "REPLICATED": "deepseek.shapes",
    "ROWWISE": "deepseek.shapes",
    "ROWWISE_PARTIAL": "deepseek.shapes",
    "Weight": "deepseek.shapes",
    "weights_by_path": "deepseek.shapes",
    "GroupedExperts": "deepseek.moe",
    "block_weights": "deepseek.shapes",
    "layer_weights": "deepseek.shapes",
    "MoE": "deepseek.moe",
    "count_slots": "deepseek.moe",
    "grouped_swiglu": "deepseek.moe",
    "init_adapters": "deepseek.init",
    "ModelOutput": "deepseek.transformer",
    "SEQUENCE": "deepseek.shapes",
    "VOCAB_EMBEDDING": "deepseek.shapes",
    "VOCAB_HEAD": "deepseek.shapes",
    "model_weights": "deepseek.shapes",
}

__all__ = list(_HOME)

if TYPE_CHECKING:
    from seektrain.models.config import ModelConfig, RopeScaling
    from seektrain.models.deepseek.hf_config import config_from_hf, config_to_hf, read_config_json
    from seektrain.models.deepseek.hf_export import export_release
    from seektrain.models.deepseek.hf_io import (
        declared_config,
        from_pretrained,
        open_hf_source,
        pretrained_config,
        save_pretrained,
    )
    from seektrain.models.deepseek.hf_replace import check_target
    from seektrain.models.deepseek.init import init_adapters
    from seektrain.models.deepseek.moe import GroupedExperts, MoE, count_slots, grouped_swiglu
    from seektrain.models.deepseek.presets import OFFICIAL_PRESETS, PRESETS
    from seektrain.models.deepseek.rope_overrides import with_rope_overrides
    from seektrain.models.deepseek.shapes import (
        COLWISE,
        EMBEDDING,
        EXPERTS,
        LINEAR,
        NORM,
        REPLICATED,
        ROWWISE,
        ROWWISE_PARTIAL,
        SEQUENCE,
        VOCAB_EMBEDDING,
        VOCAB_HEAD,
        Weight,
        block_weights,
        layer_weights,
        model_weights,
        weights_by_path,
    )
    from seektrain.models.deepseek.transformer import ModelOutput, Transformer
    from seektrain.models.param_count import ParamCounts, count_params
    from seektrain.models.registry import (
        ModelFamily,
        build_model,
        config_of,
        family_for,
        get_family,
        get_preset,
        preset_names,
        register_family,
    )


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'seektrain.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"seektrain.models.{_HOME[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
