"""Which model a job trains, in one place for the launcher, the workers and ``seektrain flops``: a named
preset (random init) or a Hugging Face folder (its config, and its weights when training starts)."""

from __future__ import annotations

import dataclasses

from seektrain.config.loader import ConfigError
from seektrain.config.schema import JobConfig
from seektrain.errors import UserError
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


def check_same_folder(hf_path: str, world_size: int) -> None:
    """Every rank reads its own slices of ``model.hf_path``, so every rank must see the same model there
    (node-local copies can differ): the folders' fingerprints are compared, a UserError names the
    first rank whose copy differs from rank 0's."""
    if world_size == 1:
        return
    import torch.distributed as dist

    from seektrain.checkpoint.lora_base import hf_fingerprint

    mine = hf_fingerprint(hf_path)
    every: list[str | None] = [None] * world_size
    dist.all_gather_object(every, mine)
    for rank, other in enumerate(every):
        if other != every[0]:
            raise UserError(
                f"model.hf_path={hf_path}: rank {rank} sees a different model there than rank 0 "
                f"(fingerprint {str(other)[:12]} vs {str(every[0])[:12]}); give every node the same copy"
            )
