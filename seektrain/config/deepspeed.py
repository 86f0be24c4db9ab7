"""Import a DeepSpeed ``ds_config.json``: each DeepSpeed key becomes ``--set`` overrides of our config.

Why overrides and not a second config object: the DeepSpeed file is applied over the TOML config and
under the user's own ``--set``, so it joins the one path every config takes (``load_config``) and is
validated there like any override. Rules, so that nothing is silently dropped:

- a key we map sets our key (and says which DeepSpeed key it came from);
- a key we do not have the feature for gets one note saying what seektrain does instead;
- a block present in the file brings DeepSpeed's defaults for the keys it omits (that is what
  DeepSpeed would run); a block absent keeps ours;
- a value ``"auto"`` (Hugging Face's convention: its Trainer fills it in) keeps ours, and a note says
  which value and where it came from, so an all-"auto" file visibly trains on our config;
- a feature that would change what is trained (sparse attention, Lamb, curriculum learning, ...) is
  refused with its reason; the same block with ``"enabled": false`` is only noted;
- a misspelt key, or a value of the wrong type, is one short ``ConfigError`` line naming the key.

The keys around the training math (parallel degrees, monitors, the noted and refused keys) are in
``seektrain.config.deepspeed_other``; the tables of keys in ``seektrain.config.deepspeed_keys``.

``docs/configuration.md`` ("From DeepSpeed") holds the table of this mapping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from seektrain.config import deepspeed_other
from seektrain.config.deepspeed_batch import (
    ACCUM,
    MICRO,
    TRAIN,
    WORLD_SIZE_HINT,
    data_parallel_size,
    resolve_batch,
)
from seektrain.config.deepspeed_keys import (
    ACTIVATION_CHECKPOINT_KEYS,
    AUTO,
    BF16_KEYS,
    FP16_KEYS,
    OFFLOAD_KEYS,
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    ZERO_FSDP_KEYS,
    ZERO_OFFLOAD_KEYS,
    check_known,
    positive,
    read_deepspeed,
    source,
    value_of,
)
from seektrain.config.loader import ConfigError, load_config
from seektrain.config.schema import JobConfig


@dataclass
class DeepSpeedImport:
    """What a DeepSpeed file sets, in order: (our key, value, where it came from), and the notes."""

    settings: list[tuple[str, object, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def overrides(self) -> list[str]:
        """``section.key=value`` strings, as ``--set`` takes them."""
        return [f"{key}={_set_value(value)}" for key, value, _ in self.settings]

    def sources(self) -> dict[str, str]:
        """Our key -> the DeepSpeed key(s) it came from (the last setting of a key wins)."""
        return {key: source for key, _, source in self.settings}


def _set_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------- the mapping
class _Mapper:
    def __init__(self, ds: dict, base: JobConfig, world_size: int | None, later: dict[str, str]):
        self.ds, self.base, self.world_size, self.later = ds, base, world_size, later
        self.out = DeepSpeedImport()
        # DeepSpeed key at "auto" -> our key(s) whose value stands in for it (None: nothing to fill in)
        self.autos: dict[str, str | tuple[str, ...] | None] = {}

    def set(self, key: str, value, source: str) -> None:
        self.out.settings.append((key, value, source))

    def note(self, text: str) -> None:
        self.out.notes.append(text)

    def read(self, block: dict, where: str, key: str, kind: str, default, ours):
        """``value_of`` where "auto" is allowed: None for "auto", which is remembered with the key of
        ours whose value stands in for it (None: nothing of ours to fill in), for the notes."""
        if block.get(key) == AUTO:
            self.autos[f"{where}.{key}" if where else key] = ours
        return value_of(block, where, key, kind, default, auto=True)

    def final(self, key: str, parse=int):
        """The value ``key`` ends with: the user's --set, else this file, else the TOML config."""
        if key in self.later:
            try:
                return parse(self.later[key])
            except ValueError:
                pass  # a malformed --set: load_config reports it, naming the key
        for ours, value, _ in reversed(self.out.settings):
            if ours == key:
                return value
        section, _, name = key.partition(".")
        return getattr(getattr(self.base, section), name)

    def run(self) -> DeepSpeedImport:
        deepspeed_other.top_level_keys(self)  # unknown keys first: a typo is reported before anything
        deepspeed_other.parallel_degrees(self)
        self.precision()
        self.zero()
        self.optimizer_and_scheduler()
        self.small_keys()
        deepspeed_other.monitors(self)
        deepspeed_other.noted_and_refused(self)
        self.batch()  # after the degrees: it needs the final tp, pp and cp
        deepspeed_other.auto_notes(self)  # last: the values that stand in for "auto" are final
        return self.out

    def precision(self) -> None:
        fp16 = value_of(self.ds, "", "fp16", "block")
        bf16_name = "bfloat16" if "bfloat16" in self.ds and "bf16" not in self.ds else "bf16"  # older name
        bf16 = value_of(self.ds, "", bf16_name, "block")
        autocast = value_of(self.ds, "", "torch_autocast", "block")
        if fp16 is None and bf16 is None and not (autocast or {}).get("enabled"):
            self.note(
                f"no fp16/bf16 block: DeepSpeed would train in fp32; keeping precision.dtype="
                f"{self.base.precision.dtype} from the config"
            )
            return
        fp16, bf16 = fp16 or {}, bf16 or {}
        check_known(fp16, "fp16", FP16_KEYS)
        check_known(bf16, bf16_name, BF16_KEYS)
        fp16_on = self.read(fp16, "fp16", "enabled", "bool", False, "precision.dtype")
        bf16_on = self.read(bf16, bf16_name, "enabled", "bool", False, "precision.dtype")
        if fp16_on and bf16_on:
            raise ConfigError(
                f"DeepSpeed keys fp16.enabled and {bf16_name}.enabled are both true; enable one of them"
            )
        if autocast is not None:
            fp16_on, bf16_on = self.torch_autocast(autocast, fp16_on, bf16_on)
        if fp16_on is None or bf16_on is None:  # "auto": Hugging Face's Trainer decides; so does our config
            for name, block, on in (("fp16", fp16, fp16_on), (bf16_name, bf16, bf16_on)):
                if on is False and "enabled" in block:
                    self.note(
                        f'{name}.enabled=false: the other block is "auto", so precision.dtype is the config\'s'
                    )
            return
        dtype = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
        self.set(
            "precision.dtype",
            dtype,
            f"fp16.enabled={json.dumps(fp16_on)}, {bf16_name}.enabled={json.dumps(bf16_on)}"
            + (" (fp16 only: neither DeepSpeed's fp16 block nor seektrain trains in FP8)" if fp16_on else ""),
        )
        for key in (
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
            "fp16_master_weights_and_grads",
        ):
            block, name = (bf16, bf16_name) if key.startswith("bf16") else (fp16, "fp16")
            if value_of(block, name, key, "bool"):
                self.note(
                    f"{name}.{key}=true: seektrain keeps master weights, gradients and optimizer state "
                    "in fp32 always"
                )
        if fp16_on:
            self.note(
                "fp16.enabled: fp16 needs loss scaling and overflows more easily than bf16; DeepSeek models "
                "train in bf16 on GPUs that have it (A100, H100): precision.dtype=bf16"
            )
            self.loss_scale(fp16)

    def torch_autocast(self, autocast: dict, fp16_on, bf16_on):
        """DeepSpeed's torch_autocast block: its dtype is the compute dtype when no fp16/bf16 block is
        on (seektrain always runs the forward under autocast to precision.dtype)."""
        check_known(autocast, "torch_autocast", ("enabled", "dtype", "lower_precision_safe_modules"))
        if fp16_on or bf16_on or not value_of(autocast, "torch_autocast", "enabled", "bool", False):
            self.note("torch_autocast: seektrain always runs the forward under autocast to precision.dtype")
            return fp16_on, bf16_on
        dtype = value_of(autocast, "torch_autocast", "dtype", "str", "torch.bfloat16")
        if dtype not in ("torch.bfloat16", "bfloat16", "bf16", "torch.float16", "float16", "fp16"):
            raise ConfigError(
                f"DeepSpeed key torch_autocast.dtype={dtype}: use torch.bfloat16 or torch.float16"
            )
        if "lower_precision_safe_modules" in autocast:
            self.note(
                "torch_autocast.lower_precision_safe_modules: seektrain autocasts every matmul of the model"
            )
        bf16 = dtype in ("torch.bfloat16", "bfloat16", "bf16")
        return not bf16, bf16

    def loss_scale(self, fp16: dict) -> None:
        static = value_of(fp16, "fp16", "loss_scale", "number", 0)
        power = value_of(fp16, "fp16", "initial_scale_power", "int", 16)
        window = positive(value_of(fp16, "fp16", "loss_scale_window", "int", 1000), "fp16.loss_scale_window")
        if static < 0:
            raise ConfigError(f"DeepSpeed key fp16.loss_scale: must be >= 0 (0 = dynamic), got {static}")
        if static:
            self.set("precision.loss_scale_init", float(static), f"fp16.loss_scale={static}")
            self.note(
                f"fp16.loss_scale={static} asks for a static loss scale; seektrain's scale is always "
                f"dynamic: it starts at {static}, halves on an overflow (skipping that step) and doubles "
                f"after {window} clean steps"
            )
        else:
            self.set(
                "precision.loss_scale_init",
                float(2**power),
                source(fp16, "fp16", "initial_scale_power", power) + f" (2**{power})",
            )
        self.set(
            "precision.loss_scale_growth_interval", window, source(fp16, "fp16", "loss_scale_window", window)
        )
        hysteresis = value_of(fp16, "fp16", "hysteresis", "int", 2)
        if not static and (hysteresis != 1 or "consecutive_hysteresis" in fp16):
            self.note(
                f"{source(fp16, 'fp16', 'hysteresis', hysteresis)}: seektrain halves the loss scale at every "
                "overflow (hysteresis 1, no consecutive_hysteresis)"
            )
        min_scale = value_of(fp16, "fp16", "min_loss_scale", "number", 1)
        if min_scale != 1:
            self.note(f"fp16.min_loss_scale={min_scale}: seektrain's loss scale never goes below 1")
        if "auto_cast" in fp16:
            self.note("fp16.auto_cast: seektrain always runs the forward under autocast to precision.dtype")

    def zero(self) -> None:
        zero = value_of(self.ds, "", "zero_optimization", "block")
        if zero is None:
            self.note(
                "no zero_optimization block: DeepSpeed would replicate the model (stage 0); keeping "
                f"parallel.data_parallel={self.base.parallel.data_parallel} from the config"
            )
            return
        check_known(zero, "zero_optimization", ("stage", *ZERO_OFFLOAD_KEYS, *ZERO_FSDP_KEYS))
        stage = value_of(zero, "zero_optimization", "stage", "int", 0)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeed key zero_optimization.stage: use 0, 1, 2 or 3, got {stage}")
        src = f"zero_optimization.stage={stage}"
        ddp = stage == 0 and self.final("parallel.pp") == 1
        if ddp:
            self.set("parallel.data_parallel", "ddp", src)
            self.set("parallel.dp_shard", 1, src + " (DDP replicates the model)")
            self.zero_replicas(src)
        else:
            if stage == 0:
                self.note(
                    "zero_optimization.stage=0 with pipeline parallelism: seektrain composes stages with "
                    "FSDP only, so it shards like stage 2 (FSDP without resharding)"
                )
            self.set("parallel.data_parallel", "fsdp", src)
            self.set("parallel.reshard_after_forward", stage == 3, src)
            if stage == 1:
                self.note(
                    "zero_optimization.stage=1 shards optimizer state only; seektrain's nearest is FSDP "
                    "without resharding after forward (ZeRO-2-like: gradients are sharded too, which "
                    "needs less memory)"
                )
        for key in ZERO_OFFLOAD_KEYS:
            self.offload(zero, key)
        tuned = [key for key in zero if key in ZERO_FSDP_KEYS]
        if tuned:
            ours = (
                "DDP buckets its gradient all-reduces itself during backward"
                if ddp
                else "FSDP2 schedules its per-block all-gathers and reduce-scatters itself"
            )
            self.note(
                f"zero_optimization: {', '.join(tuned)} tune DeepSpeed's own buckets and overlap; "
                f"{ours}, so they are ignored"
            )

    def zero_replicas(self, src: str) -> None:
        if self.world_size is None:
            raise ConfigError(
                "DeepSpeed key zero_optimization.stage=0 (DDP) needs the data-parallel size for "
                f"parallel.dp_replicate; {WORLD_SIZE_HINT}"
            )
        dp = data_parallel_size(*self.degrees())
        self.set("parallel.dp_replicate", dp, src + f" (data-parallel size {dp})")

    def degrees(self) -> tuple[int, int, int, int]:
        """(world size, tp, pp, cp) as the run will have them; the world size must be known."""
        assert self.world_size is not None
        return (
            self.world_size,
            self.final("parallel.tp"),
            self.final("parallel.pp"),
            self.final("parallel.cp"),
        )

    def offload(self, zero: dict, key: str) -> None:
        if key.startswith("cpu_offload"):  # DeepSpeed's older booleans
            on = value_of(zero, "zero_optimization", key, "bool")
            device, src = ("cpu" if on else None), f"zero_optimization.{key}=true"
        else:
            block = value_of(zero, "zero_optimization", key, "block", {})
            check_known(block, f"zero_optimization.{key}", OFFLOAD_KEYS)
            device = value_of(block, f"zero_optimization.{key}", "device", "str", "none")
            device = None if device == "none" else device
            src = f"zero_optimization.{key}.device={device}"
        if device:
            # FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together: either
            # DeepSpeed offload turns all of it on
            self.set("parallel.cpu_offload", True, src)
            if device != "cpu":
                self.note(
                    f"zero_optimization.{key} to {device}: seektrain offloads to host memory only "
                    "(parallel.cpu_offload: parameters, gradients and optimizer state), not to NVMe"
                )

    def optimizer_and_scheduler(self) -> None:
        peak = None
        opt = value_of(self.ds, "", "optimizer", "block")
        if opt is not None:
            check_known(opt, "optimizer", ("type", "params"))
            kind = value_of(opt, "optimizer", "type", "str", "AdamW")
            if kind.lower() not in ("adam", "adamw"):
                raise ConfigError(
                    f"DeepSpeed key optimizer.type={kind}: seektrain trains with AdamW, and {kind} updates the "
                    "weights differently; use Adam or AdamW"
                )
            params = value_of(opt, "optimizer", "params", "block", {})
            check_known(params, "optimizer.params", OPTIMIZER_PARAMS)
            where = "optimizer.params"
            if "max_grad_norm" in params:
                raise ConfigError(
                    f"DeepSpeed key {where}.max_grad_norm: DeepSpeed refuses it for Adam too; "
                    "move it to the top-level gradient_clipping"
                )
            peak = positive(self.read(params, where, "lr", "number", 1e-3, "optim.lr"), where + ".lr")
            if peak is not None:
                self.set("optim.lr", float(peak), source(params, where, "lr", peak))
            betas = self.read(params, where, "betas", "list", [0.9, 0.999], ("optim.beta1", "optim.beta2"))
            if betas is not None:
                if len(betas) != 2 or not all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas
                ):
                    raise ConfigError(
                        f"DeepSpeed key {where}.betas: expected two numbers, got {json.dumps(betas)}"
                    )
                self.set("optim.beta1", float(betas[0]), source(params, where, "betas", betas))
                self.set("optim.beta2", float(betas[1]), source(params, where, "betas", betas))
            for key, ours, default in (
                ("eps", "optim.eps", 1e-8),
                ("weight_decay", "optim.weight_decay", 0.0),
            ):
                value = self.read(params, where, key, "number", default, ours)
                if value is not None:
                    self.set(ours, float(value), source(params, where, key, value))
            if kind.lower() == "adam" and value_of(params, where, "adam_w_mode", "bool", True) is False:
                self.note(
                    "optimizer.params.adam_w_mode=false (L2 weight decay inside Adam): seektrain's AdamW "
                    "decays weights decoupled, so the same weight_decay acts differently"
                )
        sched = value_of(self.ds, "", "scheduler", "block")
        if sched is not None:
            self.scheduler(sched, peak)

    def scheduler(self, sched: dict, optimizer_lr) -> None:
        check_known(sched, "scheduler", ("type", "params"))
        kind = value_of(sched, "scheduler", "type", "str", "")
        if kind not in SCHEDULER_PARAMS:
            raise ConfigError(
                f"DeepSpeed key scheduler.type={kind or '(missing)'}: seektrain's schedule is warmup "
                f"+ cosine; use one of {', '.join(SCHEDULER_PARAMS)}"
            )
        params = value_of(sched, "scheduler", "params", "block", {})
        where = "scheduler.params"
        check_known(params, where, SCHEDULER_PARAMS[kind])
        warmup = self.read(params, where, "warmup_num_steps", "int", 1000, "optim.warmup_steps")
        if warmup is not None:
            self.set(
                "optim.warmup_steps",
                positive(warmup, where + ".warmup_num_steps"),
                source(params, where, "warmup_num_steps", warmup),
            )
        if value_of(params, where, "warmup_type", "str", "log") != "linear":
            self.note(
                f"{where}.warmup_type={params.get('warmup_type', 'log')}: seektrain warms up linearly "
                "(DeepSpeed's default is log)"
            )
        if value_of(params, where, "last_batch_iteration", "int", -1) != -1:
            self.note(f"{where}.last_batch_iteration: seektrain resumes the schedule from its checkpoints")
        if kind != "WarmupLR" and "total_num_steps" not in params:
            raise ConfigError(
                f'DeepSpeed key {where}.total_num_steps is required by {kind}; set it (or "auto" '
                "to keep train.steps)"
            )
        total = positive(
            self.read(params, where, "total_num_steps", "int", None, "train.steps"),
            where + ".total_num_steps",
        )
        if total is not None:
            self.set("train.steps", total, f"{where}.total_num_steps={total}")
        if kind == "WarmupCosineLR":  # the optimizer's lr is the peak; ratios around it
            start = value_of(params, where, "warmup_min_ratio", "number", 0.0)
            ratio = self.read(params, where, "cos_min_ratio", "number", 0.0001, "optim.min_lr_ratio")
            if ratio is not None:
                self.set("optim.min_lr_ratio", float(ratio), source(params, where, "cos_min_ratio", ratio))
            if start:
                self.note(f"{where}.warmup_min_ratio={start}: seektrain's warmup starts from lr/warmup_steps")
            return
        default_peak = 0.001 if kind == "WarmupDecayLR" else None  # WarmupLR's default: the optimizer's lr
        peak = self.read(params, where, "warmup_max_lr", "number", default_peak, "optim.lr")
        low = self.read(
            params,
            where,
            "warmup_min_lr",
            "number",
            0.0,
            None if kind == "WarmupLR" else "optim.min_lr_ratio",
        )
        if peak is not None:
            if optimizer_lr is not None and peak != optimizer_lr:
                self.note(
                    f"optimizer.params.lr={optimizer_lr} is replaced by {where}.warmup_max_lr={peak}, as "
                    "DeepSpeed's scheduler does"
                )
            self.set(
                "optim.lr",
                float(positive(peak, where + ".warmup_max_lr")),
                source(params, where, "warmup_max_lr", peak),
            )
        if peak is None:
            peak = optimizer_lr if optimizer_lr is not None else self.final("optim.lr", float)
        if low:
            self.note(
                f"{where}.warmup_min_lr={low}: seektrain's warmup starts from lr/warmup_steps"
                + (" (the decay still ends at warmup_min_lr)" if kind == "WarmupDecayLR" else "")
            )
        if kind == "WarmupLR":
            self.set("optim.min_lr_ratio", 1.0, "scheduler.type=WarmupLR (constant lr after warmup)")
        else:
            if low is not None:
                if peak > 0:  # else the lr is refused by load_config, naming the key that set it
                    self.set(
                        "optim.min_lr_ratio", min(low / peak, 1.0), f"{where}.warmup_min_lr / warmup_max_lr"
                    )
            self.note(
                "scheduler.type=WarmupDecayLR decays linearly; seektrain decays by a cosine between the same "
                "end points (same lr at the start, middle and end of the decay; higher before the middle, "
                "lower after)"
            )

    def small_keys(self) -> None:
        clip = self.read(self.ds, "", "gradient_clipping", "number", None, "train.grad_clip")
        if clip is not None:
            if clip < 0:
                raise ConfigError(f"DeepSpeed key gradient_clipping: must be >= 0, got {clip}")
            self.set("train.grad_clip", float(clip), f"gradient_clipping={clip}")
        every = positive(value_of(self.ds, "", "steps_per_print", "int"), "steps_per_print")
        if every is not None:
            self.set("run.log_interval", every, f"steps_per_print={every}")
        ac = value_of(self.ds, "", "activation_checkpointing", "block")
        if ac is not None:
            check_known(ac, "activation_checkpointing", ACTIVATION_CHECKPOINT_KEYS)
            for key in ACTIVATION_CHECKPOINT_KEYS:
                value_of(
                    ac, "activation_checkpointing", key, "int" if key == "number_checkpoints" else "bool"
                )
            self.set("train.activation_checkpoint", "full", "activation_checkpointing block")
            extras = [key for key in ("partition_activations", "cpu_checkpointing") if ac.get(key)]
            if extras:
                self.note(
                    f"activation_checkpointing.{', '.join(extras)}: seektrain recomputes every decoder block "
                    "in backward and keeps the saved inputs on the GPU, unpartitioned"
                )
        self.gradient_reduction()

    def gradient_reduction(self) -> None:
        """communication_data_type (the dtype of the gradient reduction) and gradient_allreduce_op."""
        comm = value_of(self.ds, "", "communication_data_type", "str")
        if comm is not None:
            if comm not in ("fp32", "fp16", "bf16"):
                raise ConfigError(f"DeepSpeed key communication_data_type={comm}: use fp32, fp16 or bf16")
            if comm == "fp16":
                self.note(
                    "communication_data_type=fp16: seektrain reduces gradients in fp32 or bf16 "
                    "(precision.reduce_dtype), never fp16; keeping "
                    f"precision.reduce_dtype={self.base.precision.reduce_dtype}"
                )
            else:
                self.set("precision.reduce_dtype", comm, f"communication_data_type={comm}")
        op = value_of(self.ds, "", "gradient_allreduce_op", "str")
        if op is not None and op != "mean":
            raise ConfigError(
                f"DeepSpeed key gradient_allreduce_op={op}: seektrain averages gradients over the "
                "data-parallel ranks (mean); a sum scales them by the rank count; use mean"
            )
        if op == "mean":
            self.note("gradient_allreduce_op=mean: seektrain averages gradients the same way")

    def batch(self) -> None:
        ours = {TRAIN: "train.global_batch_size", MICRO: "train.micro_batch_size", ACCUM: None}
        values = {k: positive(self.read(self.ds, "", k, "int", None, ours[k]), k) for k in ours}
        train, micro, accum = values[TRAIN], values[MICRO], values[ACCUM]
        if train is None and micro is None:
            if accum is None:
                return  # no batch keys (or all "auto"): the config's batch stands
            micro = self.final("train.micro_batch_size")
        tp, pp, cp = self.final("parallel.tp"), self.final("parallel.pp"), self.final("parallel.cp")
        dp = None if self.world_size is None else data_parallel_size(*self.degrees())
        batch = resolve_batch(train, micro, accum, dp)
        given = [f"{k}={v}" for k, v in values.items() if v is not None]
        if values[TRAIN] is None and values[MICRO] is None:  # accumulation alone: our micro batch
            given.append(f"train.micro_batch_size={micro}")
        self.set("train.global_batch_size", batch.train_batch_size, ", ".join(given))
        self.set("train.micro_batch_size", batch.micro_batch_size, ", ".join(given))
        if dp is None and accum is not None:
            implied = batch.train_batch_size // (batch.micro_batch_size * accum)
            self.note(
                f"batch: {TRAIN} {batch.train_batch_size} = {batch.micro_batch_size} × {accum} × data-parallel "
                f"size {implied}; the run derives its accumulation from the data-parallel size it is "
                "launched with"
            )
        if dp is not None:
            where = (
                f"world size {self.world_size} / (tp {tp} × pp {pp}" + (f" × cp {cp})" if cp > 1 else ")")
                if tp * pp * cp > 1
                else "world size"
            )
            self.note(
                f"batch: {batch.train_batch_size} sequences per step = micro {batch.micro_batch_size} × "
                f"accumulation {batch.accumulation} × data-parallel size {dp} ({where})"
            )
            megatron = any(
                k in self.ds for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
            )
            if tp * pp > 1 and megatron and train is None:
                assert self.world_size is not None and batch.accumulation is not None  # dp is known
                ds_train = batch.micro_batch_size * batch.accumulation * self.world_size
                self.note(
                    f"DeepSpeed, which ignores tensor_model_parallel_size and pipeline_model_parallel_size, "
                    f"would instead run {self.world_size}-way data parallel with train_batch_size "
                    f"{batch.micro_batch_size} × {batch.accumulation} × {self.world_size} = {ds_train}"
                )


# ---------------------------------------------------------------------------------------- entry points
def map_deepspeed(
    ds: dict,
    base: JobConfig | None = None,
    world_size: int | None = None,
    later_overrides: list[str] | tuple[str, ...] = (),
) -> DeepSpeedImport:
    """The settings and notes of a DeepSpeed config applied over ``base``; ``later_overrides`` are the
    ``--set`` items that will follow (their tp, pp and micro batch size count in the batch rule)."""
    later = {}
    for item in later_overrides:
        key, sep, value = item.partition("=")
        if sep:
            later[key.strip()] = value.strip()
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    return _Mapper(ds, base or JobConfig(), world_size, later).run()


def load_config_with_deepspeed(
    ds_path: str | Path,
    config_path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    world_size: int | None = None,
) -> tuple[JobConfig, DeepSpeedImport]:
    """TOML config, then the DeepSpeed file, then ``overrides``: the validated config and what the
    DeepSpeed file set. Errors name the DeepSpeed file."""
    base = load_config(config_path)
    try:
        imported = map_deepspeed(read_deepspeed(ds_path), base, world_size, overrides)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(
            message if message.startswith("DeepSpeed config") else f"{ds_path}: {message}"
        ) from None
    return load_config(config_path, [*imported.overrides(), *overrides]), imported
