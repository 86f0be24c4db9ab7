"""The DeepSeek model family in plain PyTorch (dense DeepSeek-LLM, DeepSeek-V2, DeepSeek-V3)."""

from seektrain.models.config import ModelConfig, RopeScaling
from seektrain.models.param_count import ParamCounts, count_params
from seektrain.models.presets import OFFICIAL_PRESETS, PRESETS, get_preset
from seektrain.models.transformer import Transformer, build_model

__all__ = [
    "ModelConfig", "RopeScaling", "ParamCounts", "count_params", "OFFICIAL_PRESETS", "PRESETS",
    "get_preset", "Transformer", "build_model",
]
