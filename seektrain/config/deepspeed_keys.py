"""The DeepSpeed keys seektrain knows, and how one value is read: type-checked, one line per mistake.

Why apart from the mapping (``seektrain.config.deepspeed``): these tables are the answer to "which keys
are known" that every unknown-key error lists, and the docs' table is checked against them.
"""

from __future__ import annotations

import json
from pathlib import Path

from seektrain.config.deepspeed_batch import ACCUM, MICRO, TRAIN
from seektrain.config.loader import ConfigError

# DeepSpeed's zero_optimization keys that tune its own bucketing, overlap and partitioning: FSDP2 makes
# these choices itself (one all-gather / reduce-scatter per decoder block, prefetching the next block).
ZERO_FSDP_KEYS = (
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "sub_group_size",
    "cpu_offload_use_pin_memory",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "leaf_module",
    "zenflow",
    *(
        f"{prefix}{key}"
        for key in (
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "model_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "gather_16bit_weights_on_model_save",
            "module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "allgather_sequential",
            "partition_stream_chunk_size",
        )
        for prefix in ("", "stage3_")
    ),
    "stage3_gather_fp16_weights_on_model_save",
)
ZERO_OFFLOAD_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param")
OFFLOAD_KEYS = (
    "device",
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pin_memory",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "ratio",
)
FP16_KEYS = (
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
)
BF16_KEYS = (
    "enabled",
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
)
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction")
SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": (
        "total_num_steps",
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    ),
    "WarmupCosineLR": (
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    ),
}
ACTIVATION_CHECKPOINT_KEYS = (
    "partition_activations",
    "contiguous_memory_optimization",
    "cpu_checkpointing",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)
MONITOR_KEYS = {
    "tensorboard": ("enabled", "output_path", "job_name"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "project", "group", "team"),
}
TOP_LEVEL_KEYS = (
    TRAIN,
    MICRO,
    ACCUM,
    "fp16",
    "bf16",
    "bfloat16",
    "zero_optimization",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "activation_checkpointing",
    "steps_per_print",
    *MONITOR_KEYS,
    "wall_clock_breakdown",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)

AUTO = "auto"
_MISSING = object()


def value_of(block: dict, where: str, key: str, kind: str, default=_MISSING, auto: bool = False):
    """``block[key]`` checked to be of ``kind`` (int, number, bool, str, block, list), or ``default``
    when absent; ``"auto"`` (when allowed) and absence without a default give None."""
    dotted = f"{where}.{key}" if where else key
    if block.get(key) is None:  # absent, or JSON null (DeepSpeed's "not set")
        return None if default is _MISSING else default
    value = block[key]
    if auto and value == AUTO:
        return None
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "block": isinstance(value, dict),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        wanted = {
            "int": "an integer",
            "number": "a number",
            "bool": "true or false",
            "str": "a string",
            "block": "a {...} block",
            "list": "a list",
        }[kind]
        or_auto = ' or "auto"' if auto else ""
        raise ConfigError(f"DeepSpeed key {dotted}: expected {wanted}{or_auto}, got {json.dumps(value)}")
    return value


def source(block: dict, where: str, key: str, value) -> str:
    """``where.key=value``, marked when the value is DeepSpeed's default for an absent key."""
    return f"{where}.{key}={json.dumps(value)}" + ("" if key in block else " (DeepSpeed's default)")


def positive(value, dotted: str):
    if value is not None and value <= 0:
        raise ConfigError(f"DeepSpeed key {dotted}: must be > 0, got {value}")
    return value


def check_known(block: dict, where: str, known) -> None:
    for key in block:
        if key not in known:
            raise ConfigError(
                f"unknown DeepSpeed key {(where + '.') if where else ''}{key}; keys seektrain "
                f"knows{' in ' + where if where else ''}: {', '.join(known)}"
            )


def read_deepspeed(path: str | Path) -> dict:
    """The JSON object of a DeepSpeed config file; a duplicate key is an error, as in DeepSpeed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} not found")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            raise ConfigError(f"DeepSpeed config {path}: key {dup!r} appears twice")
        return dict(pairs)

    try:
        data = json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError(f"DeepSpeed config {path} nests too deeply to be a config; fix the file") from None
    except OSError as err:
        raise ConfigError(
            f"DeepSpeed config {path} cannot be read ({err.strerror}); check its permissions"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path}: expected a JSON object {{...}} at the top")
    return data
