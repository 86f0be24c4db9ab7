"""Checks of a parallel layout against the model, run before any worker starts: every layout that
cannot work (heads or experts that do not divide, more stages than layers, micro-batches that do not
split) is refused with one line naming the setting."""

from __future__ import annotations

from seektrain.config.loader import ConfigError
from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.parallel.layout import ParallelLayout


def resolve_model_config(cfg: JobConfig) -> ModelConfig:
    """The model config without loading weights (a Hugging Face folder's config.json, or the preset)."""
    if cfg.model.hf_path:
        from seektrain.models.hf_config import config_from_hf, read_config_json

        return config_from_hf(read_config_json(cfg.model.hf_path))
    from seektrain.models.presets import get_preset

    return get_preset(cfg.model.preset)


def pipeline_microbatches(cfg: JobConfig, layout: ParallelLayout, accum: int) -> int:
    """Micro-batches per pipeline step; the step's sequences on one rank must split evenly into them."""
    n = cfg.parallel.pp_microbatches or accum
    local = accum * cfg.train.micro_batch_size
    if local % n:
        raise ConfigError(f"parallel.pp_microbatches={n} does not divide the {local} sequences each data-parallel "
                          "rank gets per step; pick a divisor")
    return n


def check_model_layout(cfg: JobConfig, model_cfg: ModelConfig, layout: ParallelLayout, accum: int) -> None:
    try:
        if layout.tp > 1:
            from seektrain.parallel.tensor_parallel import validate_tp

            validate_tp(model_cfg, layout.tp)
        if layout.ep > 1:
            from seektrain.parallel.expert_parallel import validate_ep

            validate_ep(model_cfg, layout.ep, layout.dp_shard, layout.tp)
        if layout.pp > 1:
            from seektrain.parallel import pipeline

            if layout.data_parallel == "ddp" and layout.dp > 1:
                raise ConfigError("parallel.pp > 1 composes with data_parallel=fsdp; set parallel.data_parallel=fsdp")
            per_rank = pipeline.stages_per_rank(cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank)
            pipeline.split_layers(model_cfg, layout.pp * per_rank, cfg.parallel.pp_split or None)
            n_mb = pipeline_microbatches(cfg, layout, accum)
            if cfg.parallel.pp_schedule == "1f1b" and n_mb < layout.pp:
                raise ConfigError(f"parallel.pp_schedule=1f1b needs at least parallel.pp={layout.pp} micro-batches "
                                  f"per step but gets {n_mb}; set parallel.pp_microbatches or raise "
                                  "train.global_batch_size")
            if cfg.parallel.pp_schedule in pipeline.MULTI_STAGE and n_mb % layout.pp:
                raise ConfigError(f"parallel.pp_schedule={cfg.parallel.pp_schedule} needs the number of pipeline "
                                  f"micro-batches ({n_mb}) to be a multiple of parallel.pp={layout.pp}")
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None
