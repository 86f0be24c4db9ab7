"""The DeepSpeed keys seektrain knows, and how one value is read: type-checked, one line per mistake.

Why apart from the mapping (``seektrain.config.deepspeed``): these tables are the answer to "which keys
are known" that every unknown-key error lists, and the docs' table is checked against them.
"""

from __future__ import annotations

import difflib
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
OPTIMIZER_PARAMS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "adam_w_mode",
    "torch_adam",
    "bias_correction",
    "max_grad_norm",  # refused, as DeepSpeed does for Adam: its place is gradient_clipping
)
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
MONITOR_CONFIG_KEYS = ("enabled", "tag", "comet", *MONITOR_KEYS)  # LLaMA-Factory's wrapper of the monitors
TENSOR_PARALLEL_KEYS = (
    "autotp_size",
    "tp",
    "tp_overlap_comm",
    "partition_config",
    "preset_model",
    "keep_module_on_host",
    "kernel_inject",
    "replace_with_kernel_inject",
    "dtype",
    "injection_policy_tuple",
)
EXPERT_PARALLEL_KEYS = (
    "enabled",
    "autoep_size",
    "expert_tensor_parallel_size",
    "validate_folding_routing",
    "preset_model",
    "moe_layer_pattern",
    "expert_pattern",
    "router_pattern",
    "use_grouped_mm",
    "disable_triton_grouped_mm",
    "route_norm",
    "route_scale",
    "score_apply",
    "combine_impl",
)

# Every top-level key DeepSpeed reads (DeepSpeedConfig._initialize_params in deepspeed/runtime/config.py and
# the configs it builds there: precision, zero, comm, monitor, profiling, autotuning, nebula, datastates,
# compression, aio, data_pipeline, elasticity, tensor_parallel, expert_parallel, compile; read at
# deepspeedai/DeepSpeed edaa7221), sorted by what seektrain does with it.
#
# MAPPED: a _Mapper method sets our keys from it (docs/configuration.md's table says which).
MAPPED_KEYS = (
    TRAIN,
    MICRO,
    ACCUM,
    "fp16",
    "bf16",
    "bfloat16",
    "torch_autocast",
    "zero_optimization",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "activation_checkpointing",
    "steps_per_print",
    "communication_data_type",
    "gradient_allreduce_op",
    "tensor_parallel",
    "expert_parallel",
    "sequence_parallel_size",
    "tensor_model_parallel_size",  # Megatron-LM's, which DeepSpeed does not read
    "pipeline_model_parallel_size",
    *MONITOR_KEYS,
    "comet",
    "monitor_config",
)
# NOTED: what the key does in DeepSpeed leaves the trained model the same (or seektrain does it its own
# way); the note says so. The reason completes "KEY: ...".
NOTED_KEYS = {
    "zero_allow_untested_optimizer": "lets ZeRO wrap an optimizer DeepSpeed has not tested; seektrain's "
    "FSDP trains its own AdamW",
    "zero_force_ds_cpu_optimizer": "picks DeepSpeed's CPU Adam for offloaded optimizer state; seektrain's "
    "offload steps torch's AdamW on the host",
    "prescale_gradients": "divides gradients before DeepSpeed's all-reduce rather than after: the same mean "
    "gradient; seektrain's reduce averages",
    "gradient_predivide_factor": "splits DeepSpeed's gradient averaging around its all-reduce: the same mean "
    "gradient; seektrain's reduce averages",
    "seq_parallel_communication_data_type": "dtype of DeepSpeed-Ulysses' all-to-alls; seektrain's context "
    "parallelism communicates in the compute dtype",
    "sparse_gradients": "sends embedding gradients sparse in DeepSpeed: the same values, reduced dense here",
    "disable_allgather": "a DeepSpeed communication switch; FSDP2 schedules its own collectives",
    "managed_gradient_accumulation": "who calls DeepSpeed's accumulation boundary; seektrain's step "
    "accumulates train.global_batch_size / (micro × data-parallel) micro-batches itself",
    "wall_clock_breakdown": "metrics.jsonl records every step's time, throughput and MFU anyway",
    "memory_breakdown": "metrics.jsonl records every step's peak memory anyway",
    "flops_profiler": "seektrain reports MFU every step; `seektrain flops` counts the model's FLOPs",
    "comms_logger": "DeepSpeed's collective log; profile.steps writes a torch.profiler trace with every "
    "collective",
    "comms_config": "not a DeepSpeed key (DeepSpeed's is comms_logger; DeepSpeed ignores this one too)",
    "autotuning": "DeepSpeed's autotuner; `seektrain plan` (or parallel.auto=true) picks the layout",
    "dump_state": "prints DeepSpeed's engine state at start-up; `seektrain config show` prints ours",
    "aio": "tunes DeepSpeed's NVMe I/O; seektrain offloads to host memory only",
    "checkpoint": "DeepSpeed's checkpoint tags and layout; seektrain writes DCP checkpoints, resharded on "
    "load (any layout resumes any other)",
    "nebula": "Azure Nebula checkpoint service; seektrain writes DCP checkpoints under run.dir "
    "(checkpoint.async for background saves)",
    "datastates_ckpt": "DataStates asynchronous checkpoints; seektrain's are checkpoint.async",
    "data_types": "DeepSpeed's gradient-accumulation/parameter dtypes; seektrain keeps master weights, "
    "gradients and their accumulation in fp32",
    "dataloader_drop_last": "DeepSpeed's loader option; seektrain's loader packs tokens into full sequences",
    "log_level": "DeepSpeed's logger level",
    "timers": "DeepSpeed's throughput timers; metrics.jsonl records tokens/s every step",
    "graph_harvesting": "captures DeepSpeed's kernels in a CUDA graph (ROCm); train.compile is ours",
    "compile": "DeepSpeed's torch.compile wrapper; set train.compile=true for ours",
    "hybrid_engine": "DeepSpeed-Chat's generation engine for RLHF rollouts; it does not change training",
    "eigenvalue": "computes Hessian eigenvalues that only feed MoQ's quantization schedule",
    "use_data_before_expert_parallelism": "orders DeepSpeed's rank groups; seektrain's mesh lays out ranks "
    "itself",
    "pipeline": "tunes DeepSpeed's pipeline engine; seektrain's schedule is parallel.pp_schedule",
    "data_parallel_size": "seektrain derives the data-parallel size from the world size and the other degrees",
}
# REFUSED when on: features that change what is trained; with "enabled": false the block is only noted.
# The reason completes "KEY is on: ...". The value is (reason, enabled when the block does not say).
REFUSED_WHEN_ENABLED = {
    "sparse_attention": (
        "block-sparse attention changes what each token attends to; seektrain's "
        "attention is dense (MLA); remove the block",
        True,
    ),
    "curriculum_learning": (
        "it changes the sequence lengths (or data) the model sees over the run; "
        "seektrain trains on the full sequences; set enabled false",
        False,
    ),
    "data_efficiency": (
        "curriculum sampling and random-LTD change the data and the layers each token "
        "goes through; set enabled false",
        False,
    ),
    "progressive_layer_drop": ("it skips layers at random during training; set enabled false", False),
    "elasticity": (
        "it picks the batch size from the GPU count at launch; set train_batch_size and set enabled false",
        False,
    ),
    "amp": (
        "Apex AMP casts by opt_level, not as seektrain's autocast does; use an fp16 or bf16 block instead",
        False,
    ),
    "compression_training": (
        "quantization, pruning or layer reduction during training; seektrain trains "
        "the full model; set the techniques' enabled false",
        None,
    ),
    "quantize_training": ("MoQ quantizes the weights during training; set enabled false", False),
    "weight_quantization": (
        "it quantizes the weights; seektrain trains them in full precision; remove the block",
        True,
    ),
}
TOP_LEVEL_KEYS = (*MAPPED_KEYS, *NOTED_KEYS, *REFUSED_WHEN_ENABLED)

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


def close_key(key: str, known) -> str | None:
    """The known key ``key`` is most likely a misspelling of, if any."""
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return match[0] if match else None


def unknown_key(dotted: str, known) -> ConfigError:
    """One short line: the key, and the known key it is closest to (never the whole list)."""
    guess = close_key(dotted.rpartition(".")[2], known)
    hint = f"did you mean {guess}?" if guess else "docs/configuration.md (From DeepSpeed) lists the keys"
    return ConfigError(f"unknown DeepSpeed key {dotted}; {hint}")


def check_known(block: dict, where: str, known) -> None:
    for key in block:
        if key not in known:
            raise unknown_key(f"{where}.{key}" if where else key, known)


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
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"DeepSpeed config {path} cannot be read ({err.strerror}); check its permissions"
        ) from None
    text = _utf8_text(raw)
    if text is None:
        raise ConfigError(f"DeepSpeed config {path} {_not_text(raw)}")
    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError(f"DeepSpeed config {path} nests too deeply to be a config; fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path}: expected a JSON object {{...}} at the top")
    return data


def _utf8_text(raw: bytes) -> str | None:
    """The file as text, or None when it is not UTF-8 (a NUL byte is valid UTF-8 but never JSON)."""
    if b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def _not_text(raw: bytes) -> str:
    """What the bytes of a file that is not UTF-8 look like, and the fix."""
    head = raw[:64]
    utf16 = head[:2] in (b"\xff\xfe", b"\xfe\xff") or (
        len(head) >= 4 and (not any(head[1::2]) or not any(head[0::2]))
    )
    if utf16:
        return "is UTF-16 text (as some Windows editors save it); save it as UTF-8"
    return "is not UTF-8 text (a binary file?); pass the ds_config.json itself"
