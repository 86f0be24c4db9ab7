"""The DeepSpeed keys around the training math: which top-level keys are known, the parallel degrees,
the monitors, the keys that are only noted or refused, and the note for every "auto" value.

Why apart from ``seektrain.config.deepspeed``: these are table-driven (``deepspeed_keys``) and each
works on the mapper it is given, so the mapping of precision, ZeRO, optimizer, schedule and batch reads
top to bottom without them. Each function takes the ``_Mapper`` (its ``ds``, ``set``, ``note``,
``read``, ``final``).
"""

from __future__ import annotations

import json

from seektrain.config.deepspeed_keys import (
    AUTO,
    EXPERT_PARALLEL_KEYS,
    MONITOR_CONFIG_KEYS,
    MONITOR_KEYS,
    NOTED_KEYS,
    REFUSED_WHEN_ENABLED,
    TENSOR_PARALLEL_KEYS,
    TOP_LEVEL_KEYS,
    check_known,
    close_key,
    positive,
    unknown_key,
    value_of,
)
from seektrain.config.loader import ConfigError
from seektrain.config.schema import JobConfig


def top_level_keys(m) -> None:
    """A key DeepSpeed reads is handled below. Any other key DeepSpeed ignores, and so do we, with a
    note, unless it is one letter or two away from a key DeepSpeed reads: then it is a typo that
    DeepSpeed would silently drop, and it is refused with the key meant."""
    for key in m.ds:
        if key in TOP_LEVEL_KEYS:
            continue
        if key.startswith("_"):
            m.note(f"{key}: a comment (DeepSpeed skips it too)")
        elif close_key(key, TOP_LEVEL_KEYS):
            raise unknown_key(key, TOP_LEVEL_KEYS)
        else:
            m.note(f"{key}: not a DeepSpeed key (DeepSpeed ignores it, and so does seektrain)")


def parallel_degrees(m) -> None:
    """Megatron-LM's degree keys, DeepSpeed's AutoTP and AutoEP blocks and its Ulysses degree."""
    for key, ours, why in (
        (
            "tensor_model_parallel_size",
            "parallel.tp",
            "its tensor parallelism comes from a Megatron mpu or the tensor_parallel block",
        ),
        (
            "pipeline_model_parallel_size",
            "parallel.pp",
            "its pipeline stages come from PipelineModule(num_stages=...)",
        ),
    ):
        value = positive(value_of(m.ds, "", key, "int"), key)
        if value is not None:
            m.set(ours, value, f"{key}={value}")
            m.note(
                f"{key}={value}: DeepSpeed ignores this Megatron-LM key ({why}) and would train "
                f"without it; seektrain honours it as {ours}={value}"
            )
    tp = value_of(m.ds, "", "tensor_parallel", "block")
    if tp is not None:
        check_known(tp, "tensor_parallel", TENSOR_PARALLEL_KEYS)
        size = value_of(tp, "tensor_parallel", "autotp_size", "int", 0)
        if size < 0:
            raise ConfigError(f"DeepSpeed key tensor_parallel.autotp_size: must be >= 0, got {size}")
        if size:  # 0 (DeepSpeed's default) and 1: no tensor parallelism
            m.set("parallel.tp", size, f"tensor_parallel.autotp_size={size}")
        extra = [key for key in tp if key != "autotp_size"]
        if extra:
            m.note(
                f"tensor_parallel: {', '.join(extra)} steer DeepSpeed's AutoTP; seektrain's tensor-parallel "
                "plan for DeepSeek's layers is its own (parallel.tp)"
            )
    ep = value_of(m.ds, "", "expert_parallel", "block")
    if ep is not None:
        check_known(ep, "expert_parallel", EXPERT_PARALLEL_KEYS)
        size = positive(
            value_of(ep, "expert_parallel", "autoep_size", "int", 1), "expert_parallel.autoep_size"
        )
        if value_of(ep, "expert_parallel", "enabled", "bool", False):
            m.set("parallel.ep", size, f"expert_parallel.autoep_size={size}")
        else:
            m.note("expert_parallel.enabled=false: DeepSpeed's AutoEP is off; keeping parallel.ep")
        extra = [key for key in ep if key not in ("enabled", "autoep_size")]
        if extra:
            m.note(
                f"expert_parallel: {', '.join(extra)} steer DeepSpeed's AutoEP; seektrain's routing "
                "comes from the model config"
            )
    sp = positive(value_of(m.ds, "", "sequence_parallel_size", "int"), "sequence_parallel_size")
    if sp is not None:
        m.set("parallel.cp", sp, f"sequence_parallel_size={sp}")
        if sp > 1:
            m.note(
                f"sequence_parallel_size={sp}: DeepSpeed-Ulysses splits heads by all-to-all; seektrain "
                "splits each sequence over parallel.cp ranks (context parallelism): the same math"
            )


def monitors(m) -> None:
    """tensorboard, wandb, csv_monitor and comet, at the top level (DeepSpeed's place) or inside
    LLaMA-Factory's monitor_config block (which DeepSpeed does not read; we read it as meant)."""
    blocks = {name: (value_of(m.ds, "", name, "block"), name) for name in (*MONITOR_KEYS, "comet")}
    wrapper = value_of(m.ds, "", "monitor_config", "block")
    if wrapper is not None:
        check_known(wrapper, "monitor_config", MONITOR_CONFIG_KEYS)
        for name in (*MONITOR_KEYS, "comet"):
            inner = value_of(wrapper, "monitor_config", name, "block")
            if inner is not None and blocks[name][0] is None:
                blocks[name] = (inner, f"monitor_config.{name}")
        if "tag" in wrapper or "enabled" in wrapper:
            m.note(
                "monitor_config.enabled/tag: DeepSpeed reads its monitors at the top level; seektrain "
                "reads the blocks inside monitor_config as if they were there"
            )
    for name in MONITOR_KEYS:
        block, where = blocks[name]
        if block is not None:
            check_known(block, where, MONITOR_KEYS[name])
            for key in MONITOR_KEYS[name]:
                value_of(block, where, key, "bool" if key == "enabled" else "str")
    tb, where = blocks["tensorboard"]
    if tb is not None:
        on = value_of(tb, where, "enabled", "bool", False)
        m.set("metrics.tensorboard", on, f"{where}.enabled={json.dumps(on)}")
        if on and tb.get("output_path"):
            m.note(f"{where}.output_path: seektrain writes event files under run.dir/tensorboard")
        if on and tb.get("job_name"):
            m.set("run.name", tb["job_name"], f"{where}.job_name")
    csv, where = blocks["csv_monitor"]
    if csv is not None:
        on = value_of(csv, where, "enabled", "bool", False)
        m.note(
            f"{where}.enabled={json.dumps(on)}: seektrain writes every step's metrics to "
            "run.dir/metrics.jsonl (one JSON object per line) either way"
        )
    wandb, where = blocks["wandb"]
    if wandb is not None:
        on = value_of(wandb, where, "enabled", "bool", False)
        trackers = [t for t in m.base.metrics.trackers if t != "wandb"] + (["wandb"] if on else [])
        m.set("metrics.trackers", trackers, f"{where}.enabled={json.dumps(on)}")
        if on and wandb.get("project"):
            m.set("metrics.tracker_project", wandb["project"], f"{where}.project")
        for key in ("group", "team"):
            if on and wandb.get(key):
                m.note(
                    f"{where}.{key}: seektrain does not set the W&B {key}; set WANDB_"
                    f"{'RUN_GROUP' if key == 'group' else 'ENTITY'} in the environment"
                )
    comet, where = blocks["comet"]
    if comet is not None:
        on = value_of(comet, where, "enabled", "bool", False)
        m.note(
            f"{where}.enabled={json.dumps(on)}: seektrain has no Comet tracker; metrics.trackers takes "
            "wandb or mlflow"
        )


def noted_and_refused(m) -> None:
    """One note per key that leaves the training unchanged; a refusal for a feature that is on and
    would change it (its block with enabled false is only noted)."""
    for key, why in NOTED_KEYS.items():
        if key in m.ds:
            value = m.ds[key]
            shown = key if isinstance(value, (dict, list)) else f"{key}={json.dumps(value)}"
            m.note(f"{shown}: {why}; ignored")
    for key, (why, on_by_default) in REFUSED_WHEN_ENABLED.items():
        block = value_of(m.ds, "", key, "block")
        if block is None:
            continue
        if _enabled(block, on_by_default, key):
            raise ConfigError(f"DeepSpeed key {key} is on: {why}")
        m.note(f"{key}: not enabled, so DeepSpeed would not use it either; ignored")


def _enabled(block: dict, on_by_default: bool | None, where: str) -> bool:
    """The block's own ``enabled`` (a bool), else its default; None: on when any block inside it is."""
    if "enabled" in block:
        return value_of(block, where, "enabled", "bool")
    if on_by_default is None:
        return any(isinstance(v, dict) and _enabled(v, False, f"{where}.{k}") for k, v in block.items())
    return on_by_default


def auto_notes(m) -> None:
    """One note per "auto" value anywhere in the file: the value seektrain uses instead and where it
    comes from (the user's --set, another DeepSpeed key, the config file, or seektrain's default)."""
    for dotted in _autos(m.ds):
        ours = m.autos.get(dotted)
        if ours is None:
            why = (
                "seektrain derives it from train.global_batch_size, micro_batch_size and the "
                "data-parallel size"
                if dotted == "gradient_accumulation_steps"
                else "nothing to fill in (the key is ignored, see its note)"
            )
            m.note(f"{dotted}=auto -> {why}")
            continue
        keys = ours if isinstance(ours, tuple) else (ours,)
        values = ", ".join(_final_value(m, key) for key in keys)
        m.note(f"{dotted}=auto -> {values} ({', '.join(keys)}, {_origin(m, keys[0])})")


def _autos(block: dict, where: str = ""):
    for key, value in block.items():
        dotted = f"{where}.{key}" if where else key
        if value == AUTO:
            yield dotted
        elif isinstance(value, dict):
            yield from _autos(value, dotted)


def _final_value(m, key: str) -> str:
    """``key``'s value as the run will have it, as written in TOML (a --set value as typed)."""
    if key in m.later:
        return m.later[key]
    for ours, value, _ in reversed(m.out.settings):
        if ours == key:
            return json.dumps(value)
    section, _, name = key.partition(".")
    return json.dumps(getattr(getattr(m.base, section), name))


def _origin(m, key: str) -> str:
    if key in m.later:
        return "from --set"
    for ours, _, source in reversed(m.out.settings):
        if ours == key:
            return f"from DeepSpeed {source}"
    section, _, name = key.partition(".")
    default = getattr(getattr(JobConfig(), section), name)
    return "seektrain's default" if getattr(getattr(m.base, section), name) == default else "from --config"
