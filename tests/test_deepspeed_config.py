"""DeepSpeed configs: every mapping row of seektrain/config/deepspeed.py, DeepSpeed's batch rule, the
source article's ds_config.json files (tests/data/deepspeed/), `config from-deepspeed` output that loads
back equal, one-line errors, and `seektrain train --deepspeed` training."""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from pathlib import Path

import pytest

from run_cli import metrics, seektrain
from seektrain.cli.main import main
from seektrain.config.deepspeed import load_config_with_deepspeed, map_deepspeed
from seektrain.config.deepspeed_batch import resolve_batch
from seektrain.config.deepspeed_keys import TOP_LEVEL_KEYS
from seektrain.config.loader import ConfigError, load_config
from seektrain.config.schema import JobConfig
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan.run_plan import RunPlan

DATA = Path(__file__).resolve().parent / "data" / "deepspeed"
ROOT = Path(__file__).resolve().parent.parent


def mapped(ds: dict, world_size: int | None = None, base: JobConfig | None = None):
    """(our key -> value, notes as one string) of a DeepSpeed dict."""
    out = map_deepspeed(ds, base, world_size)
    return {key: value for key, value, _ in out.settings}, "\n".join(out.notes)


def one_line_error(ds: dict, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        map_deepspeed(ds, None, world_size)
    message = str(err.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------- DeepSpeed's batch rule
def deepspeed_rule(train, micro, accum, world):
    """DeepSpeed's own rule as its source states it (DeepSpeedConfig._set_batch_related_parameters, then
    _batch_assertion): fill in by floor division, then assert; None where DeepSpeed refuses."""
    if train is not None and micro is not None and accum is not None:
        pass
    elif train is not None and micro is not None:
        accum = train // micro // world
    elif train is not None and accum is not None:
        micro = train // world // accum
    elif micro is not None and accum is not None:
        train = micro * accum * world
    elif train is not None:
        accum, micro = 1, train // world
    elif micro is not None:
        train, accum = micro * world, 1
    else:
        return None
    if train <= 0 or micro <= 0 or accum <= 0 or train != micro * accum * world:
        return None
    return train, micro, accum


def test_batch_rule_agrees_with_deepspeed_on_every_small_triple():
    values = (None, 1, 2, 3, 4, 6, 8, 12, 16, 32)
    checked = 0
    for train, micro, accum, dp in itertools.product(values, values, values, (1, 2, 3, 4, 8)):
        expected = deepspeed_rule(train, micro, accum, dp)
        try:
            got = tuple(resolve_batch(train, micro, accum, dp))
        except ConfigError as err:
            assert expected is None, (train, micro, accum, dp, str(err))
            continue
        assert got == expected, (train, micro, accum, dp)
        checked += 1
    assert checked > 300


@pytest.mark.parametrize(
    "triple, dp, expected",
    [
        ((32, 4, None), 8, (32, 4, 1)),
        ((32, 2, None), 8, (32, 2, 2)),
        ((32, None, 2), 8, (32, 2, 2)),
        ((None, 4, 8), 1, (32, 4, 8)),
        ((None, 4, None), 8, (32, 4, 1)),
        ((16, None, None), 4, (16, 4, 1)),
        ((64, 4, 2), 8, (64, 4, 2)),
    ],
)
def test_batch_rule_consistent_triples(triple, dp, expected):
    assert tuple(resolve_batch(*triple, dp)) == expected


@pytest.mark.parametrize(
    "triple, dp, needle",
    [
        (
            (64, 4, 4),
            8,
            "64 != train_micro_batch_size_per_gpu × gradient_accumulation_steps × data-parallel size "
            "= 4×4×8 = 128",
        ),
        ((30, 4, None), 2, "train_batch_size=30 is not a multiple of"),
        ((32, None, 3), 8, "train_batch_size=32 is not a multiple of gradient_accumulation_steps"),
        ((None, None, 4), 8, "set train_batch_size or train_micro_batch_size_per_gpu"),
    ],
)
def test_batch_rule_inconsistent_triples(triple, dp, needle):
    with pytest.raises(ConfigError) as err:
        resolve_batch(*triple, dp)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_batch_without_world_size_maps_what_it_can_and_refuses_the_rest():
    got, _ = mapped({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})
    assert (got["train.global_batch_size"], got["train.micro_batch_size"]) == (64, 4)
    got, notes = mapped(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    )
    assert (got["train.global_batch_size"], got["train.micro_batch_size"]) == (64, 4)
    assert "64 = 4 × 2 × data-parallel size 8" in notes
    assert (
        "train_batch_size must be a multiple of train_micro_batch_size_per_gpu × gradient_accumulation_steps"
        in one_line_error(
            {"train_batch_size": 60, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
        )
    )
    for ambiguous in (
        {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8},
        {"train_batch_size": 64, "gradient_accumulation_steps": 2},
        {"train_batch_size": 64},
        {"train_micro_batch_size_per_gpu": 4},
    ):
        assert "pass --world-size N" in one_line_error(ambiguous)


def test_batch_uses_the_data_parallel_size_after_tp_and_pp():
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "tensor_model_parallel_size": 2,
    }
    got, notes = mapped(ds, world_size=8)
    assert got["train.global_batch_size"] == 2 * 4 * 4 and got["parallel.tp"] == 2
    assert "data-parallel size 4 (world size 8 / (tp 2 × pp 1))" in notes
    assert (
        "world size 6 is not divisible by parallel.tp × parallel.pp × parallel.cp = 4×1×1"
        in one_line_error({**ds, "tensor_model_parallel_size": 4}, world_size=6)
    )


def test_gradient_accumulation_alone_uses_the_configs_micro_batch_and_auto_keeps_ours():
    base = load_config(None, ["train.micro_batch_size=2"])
    got, _ = mapped({"gradient_accumulation_steps": 3}, world_size=2, base=base)
    assert (got["train.global_batch_size"], got["train.micro_batch_size"]) == (12, 2)
    got, _ = mapped(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
        },
        world_size=2,
    )
    assert "train.global_batch_size" not in got and "train.micro_batch_size" not in got


# ------------------------------------------------------------------------------- the mapping, row by row
def test_fp16_dynamic_loss_scale():
    got, notes = mapped(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 1,
                "min_loss_scale": 1,
            }
        }
    )
    assert got["precision.dtype"] == "fp16"
    assert got["precision.loss_scale_init"] == 4096.0 and got["precision.loss_scale_growth_interval"] == 500
    assert "hysteresis" not in notes and "min_loss_scale" not in notes and "static" not in notes


def test_fp16_defaults_and_what_we_do_instead():
    got, notes = mapped({"fp16": {"enabled": True}})  # DeepSpeed's defaults: 2**16, window 1000, hysteresis 2
    assert got["precision.loss_scale_init"] == 65536.0 and got["precision.loss_scale_growth_interval"] == 1000
    assert (
        "fp16.hysteresis=2 (DeepSpeed's default): seektrain halves the loss scale at every overflow" in notes
    )
    got, notes = mapped({"fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 0.25}})
    assert got["precision.loss_scale_init"] == 128.0
    assert "fp16.loss_scale=128 asks for a static loss scale; seektrain's scale is always dynamic" in notes
    assert "fp16.min_loss_scale=0.25: seektrain's loss scale never goes below 1" in notes


def test_bf16_fp32_and_absent_precision():
    assert mapped({"bf16": {"enabled": True}})[0]["precision.dtype"] == "bf16"
    assert mapped({"bfloat16": {"enabled": True}})[0]["precision.dtype"] == "bf16"
    assert mapped({"bf16": {"enabled": False}, "fp16": {"enabled": False}})[0]["precision.dtype"] == "fp32"
    got, notes = mapped({})
    assert (
        "precision.dtype" not in got
        and "DeepSpeed would train in fp32; keeping precision.dtype=auto" in notes
    )
    assert "precision.dtype" not in mapped({"bf16": {"enabled": "auto"}})[0]
    assert "enable one of them" in one_line_error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


@pytest.mark.parametrize(
    "stage, expected",
    [
        (1, {"parallel.data_parallel": "fsdp", "parallel.reshard_after_forward": False}),
        (2, {"parallel.data_parallel": "fsdp", "parallel.reshard_after_forward": False}),
        (3, {"parallel.data_parallel": "fsdp", "parallel.reshard_after_forward": True}),
        (0, {"parallel.data_parallel": "ddp", "parallel.dp_shard": 1, "parallel.dp_replicate": 4}),
    ],
)
def test_zero_stages(stage, expected):
    got, notes = mapped({"zero_optimization": {"stage": stage}}, world_size=4)
    assert {key: got[key] for key in expected} == expected
    assert ("shards optimizer state only" in notes) == (stage == 1)
    ds = {"zero_optimization": {"stage": stage}, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    cfg = load_config(None, map_deepspeed(ds, None, 4).overrides())
    plan = RunPlan.resolve(cfg, get_preset("tiny-v3"), 4)
    assert plan.uses_fsdp == (stage > 0) and plan.uses_ddp == (stage == 0)


def test_zero_stage_0_needs_the_world_size_and_bad_stages_are_refused():
    assert "pass --world-size N" in one_line_error({"zero_optimization": {"stage": 0}})
    assert "use 0, 1, 2 or 3, got 4" in one_line_error({"zero_optimization": {"stage": 4}})
    got, notes = mapped({"zero_optimization": {"stage": 0}, "pipeline_model_parallel_size": 2}, world_size=4)
    assert got["parallel.data_parallel"] == "fsdp" and "composes stages with FSDP only" in notes


def test_zero_offload_fsdp_keys_and_unknown_keys():
    got, notes = mapped(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "none"},
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": 5e8,
                "stage3_prefetch_bucket_size": 5e7,
                "stage3_gather_16bit_weights_on_model_save": True,
                "cpu_offload": None,
            }
        }
    )
    assert got["parallel.cpu_offload"] is True  # FSDP2's CPU offload policy
    assert "offload" not in notes  # to the host: nothing to say; device none: nothing offloaded
    nvme, nvme_notes = mapped({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert nvme["parallel.cpu_offload"] is True and "offloads to host memory only" in nvme_notes
    assert "parallel.cpu_offload" not in mapped({"zero_optimization": {"stage": 3}})[0]
    assert (
        "zero_optimization: overlap_comm, contiguous_gradients, reduce_bucket_size, stage3_prefetch_bucket_size, "
        "stage3_gather_16bit_weights_on_model_save tune DeepSpeed's own buckets"
    ) in notes
    assert (
        mapped({"zero_optimization": {"stage": 3, "cpu_offload_param": True}})[0]["parallel.cpu_offload"]
        is True
    )
    message = one_line_error({"zero_optimization": {"stage": 2, "overlap_com": True}})
    assert message == "unknown DeepSpeed key zero_optimization.overlap_com; did you mean overlap_comm?"
    assert "unknown DeepSpeed key zero_optimization.offload_optimizer.devic" in one_line_error(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"devic": "cpu"}}}
    )


def test_optimizer():
    got, _ = mapped(
        {
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1},
            }
        }
    )
    assert got == {
        "optim.lr": 3e-4,
        "optim.beta1": 0.9,
        "optim.beta2": 0.95,
        "optim.eps": 1e-6,
        "optim.weight_decay": 0.1,
    }
    got, _ = mapped(
        {"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    )  # DeepSpeed's defaults for the rest
    assert got == {
        "optim.lr": 1e-4,
        "optim.beta1": 0.9,
        "optim.beta2": 0.999,
        "optim.eps": 1e-8,
        "optim.weight_decay": 0.0,
    }
    got, _ = mapped(
        {
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
            }
        }
    )
    assert got == {}
    assert (
        "decays weights decoupled"
        in mapped({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})[1]
    )
    assert "use Adam or AdamW" in one_line_error({"optimizer": {"type": "Lamb", "params": {}}})
    assert "optimizer.params.betas: expected two numbers" in one_line_error(
        {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}
    )


def test_schedulers():
    got, notes = mapped(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0,
                    "warmup_max_lr": 2e-4,
                    "warmup_num_steps": 100,
                    "warmup_type": "linear",
                },
            },
        }
    )
    assert (got["optim.lr"], got["optim.warmup_steps"], got["optim.min_lr_ratio"]) == (2e-4, 100, 1.0)
    assert "optimizer.params.lr=0.001 is replaced by scheduler.params.warmup_max_lr=0.0002" in notes
    assert "warmup_type" not in notes

    got, notes = mapped(
        {
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "total_num_steps": 5000,
                    "warmup_min_lr": 1e-5,
                    "warmup_max_lr": 1e-4,
                    "warmup_num_steps": 50,
                },
            }
        }
    )
    assert (got["train.steps"], got["optim.lr"], got["optim.warmup_steps"]) == (5000, 1e-4, 50)
    assert got["optim.min_lr_ratio"] == pytest.approx(0.1)
    assert "WarmupDecayLR decays linearly; seektrain decays by a cosine between the same end points" in notes
    assert "warmup_type=log: seektrain warms up linearly" in notes

    got, notes = mapped(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 6e-4}},
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": 1000,
                    "warmup_num_steps": 10,
                    "cos_min_ratio": 0.1,
                    "warmup_min_ratio": 0.01,
                },
            },
        }
    )
    assert (got["train.steps"], got["optim.lr"], got["optim.warmup_steps"], got["optim.min_lr_ratio"]) == (
        1000,
        6e-4,
        10,
        0.1,
    )
    assert "warmup_min_ratio=0.01: seektrain's warmup starts from lr/warmup_steps" in notes
    assert "seektrain's schedule is warmup + cosine; use one of WarmupLR" in one_line_error(
        {"scheduler": {"type": "OneCycle", "params": {}}}
    )
    assert "unknown DeepSpeed key scheduler.params.cos_min_ratio" in one_line_error(
        {"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}}
    )


def test_clipping_checkpointing_logging_and_monitors():
    got, notes = mapped(
        {
            "gradient_clipping": 0.5,
            "steps_per_print": 5,
            "wall_clock_breakdown": True,
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
            "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "ds-run"},
            "csv_monitor": {"enabled": True, "output_path": "csv/"},
            "wandb": {"enabled": True, "project": "deepseek", "team": "lab"},
        }
    )
    assert got == {
        "train.grad_clip": 0.5,
        "run.log_interval": 5,
        "train.activation_checkpoint": "full",
        "metrics.tensorboard": True,
        "run.name": "ds-run",
        "metrics.trackers": ["wandb"],
        "metrics.tracker_project": "deepseek",
    }
    for needle in (
        "activation_checkpointing.partition_activations: seektrain recomputes every decoder block",
        "tensorboard.output_path: seektrain writes event files under run.dir/tensorboard",
        "csv_monitor.enabled=true: seektrain writes every step's metrics to run.dir/metrics.jsonl",
        "wandb.team: seektrain does not set the W&B team",
        "wall_clock_breakdown",
    ):
        assert needle in notes
    got, _ = mapped(
        {"tensorboard": {"enabled": False}, "wandb": {"enabled": False}, "activation_checkpointing": {}},
        base=load_config(None, ["metrics.trackers=wandb"]),
    )
    assert got == {
        "metrics.tensorboard": False,
        "metrics.trackers": [],
        "train.activation_checkpoint": "full",
    }


def test_megatron_parallel_keys_are_honoured_and_said_so():
    got, notes = mapped({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4})
    assert (got["parallel.tp"], got["parallel.pp"]) == (2, 4)
    assert "tensor_model_parallel_size=2: DeepSpeed ignores this Megatron-LM key" in notes
    assert "seektrain honours it as parallel.pp=4" in notes


# ------------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "ds, needle",
    [
        (
            {"train_batch_size": "32"},
            'DeepSpeed key train_batch_size: expected an integer or "auto", got "32"',
        ),
        ({"fp16": [True]}, "DeepSpeed key fp16: expected a {...} block, got [true]"),
        (
            {"fp16": {"enabled": "yes"}},
            'DeepSpeed key fp16.enabled: expected true or false or "auto", got "yes"',
        ),
        (
            {"zero_optimization": {"stage": "3"}},
            'DeepSpeed key zero_optimization.stage: expected an integer, got "3"',
        ),
        ({"gradient_clipping": True}, "DeepSpeed key gradient_clipping: expected a number"),
        ({"steps_per_print": 0}, "DeepSpeed key steps_per_print: must be > 0, got 0"),
        (
            {"tensorboard": {"enabled": True, "job_name": 3}},
            "DeepSpeed key tensorboard.job_name: expected a string",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": "3e-4"}}},
            "DeepSpeed key optimizer.params.lr: expected a",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {}}},
            "scheduler.params.total_num_steps is required by",
        ),
    ],
)
def test_ill_typed_values_are_one_line_naming_the_key(ds, needle):
    assert needle in one_line_error(ds)


def test_a_misspelt_key_is_one_short_line_with_the_key_meant():
    message = one_line_error({"train_batch_size": 8, "gradient_cliping": 1.0})
    assert message == "unknown DeepSpeed key gradient_cliping; did you mean gradient_clipping?"
    long = one_line_error({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 5e7}})
    assert long == (
        "unknown DeepSpeed key zero_optimization.stage3_prefetch_bucket_sise; did you mean "
        "stage3_prefetch_bucket_size?"
    )
    far = one_line_error({"zero_optimization": {"stage": 3, "xyzzy": 1}})
    assert far == (
        "unknown DeepSpeed key zero_optimization.xyzzy; docs/configuration.md (From DeepSpeed) lists the keys"
    )
    # at the top level DeepSpeed ignores a key it does not read: so do we, with a note
    _, notes = mapped({"cuda_visible_devices": 0, "_comment": "x"})
    assert "cuda_visible_devices: not a DeepSpeed key (DeepSpeed ignores it, and so does seektrain)" in notes
    assert "_comment: a comment" in notes


def test_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    for text, needle in (
        ("{", "is not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"fp16": {}, "fp16": {}}', "key 'fp16' appears twice"),
    ):
        bad.write_text(text)
        proc = seektrain("config", "from-deepspeed", str(bad), check=False)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    bad.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "los_scale": 1}}')
    proc = seektrain("config", "from-deepspeed", str(bad), check=False)
    assert proc.returncode == 2 and proc.stderr == (
        f"seektrain: error: {bad}: unknown DeepSpeed key fp16.los_scale; did you mean loss_scale?\n"
    )


# ------------------------------------------------------------------------------- the source article
def test_article_ds_config_imports_and_says_where_the_article_is_wrong():
    ds = DATA / "article_ds_config.json"
    with pytest.raises(ConfigError, match="pass --world-size N"):
        load_config_with_deepspeed(ds)
    cfg, imported = load_config_with_deepspeed(ds, None, ["model.preset=deepseek-llm-67b"], world_size=8)
    assert (cfg.parallel.tp, cfg.parallel.pp) == (4, 2)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (32, 4)
    notes = "\n".join(imported.notes)
    assert "tensor_model_parallel_size=4: DeepSpeed ignores this Megatron-LM key" in notes
    assert "would instead run 8-way data parallel with train_batch_size 4 × 8 × 8 = 256" in notes
    plan = RunPlan.resolve(cfg, get_preset("deepseek-llm-67b"), 8, "cuda")  # the layout the article meant
    assert (plan.tp, plan.pp, plan.dp, plan.accum_steps) == (4, 2, 1, 8)


def test_article_fp16_config_imports_with_its_static_scale_and_fp8_claim_corrected():
    cfg, imported = load_config_with_deepspeed(DATA / "article_fp16.json")
    assert cfg.precision.dtype == "fp16" and cfg.precision.loss_scale_init == 128.0
    assert (
        "neither DeepSpeed's fp16 block nor seektrain trains in FP8" in imported.sources()["precision.dtype"]
    )
    notes = "\n".join(imported.notes)
    assert "fp16.loss_scale=128 asks for a static loss scale" in notes and "precision.dtype=bf16" in notes


def test_hugging_face_zero3_template_with_auto_values_imports():
    cfg, _ = load_config_with_deepspeed(DATA / "hf_zero3_auto.json")
    defaults = JobConfig()
    assert (cfg.parallel.data_parallel, cfg.parallel.reshard_after_forward) == ("fsdp", True)
    assert (cfg.optim, cfg.precision, cfg.train.grad_clip) == (
        defaults.optim.__class__(min_lr_ratio=1.0),
        defaults.precision,
        defaults.train.grad_clip,
    )  # "auto": ours, WarmupLR: constant
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (16, 8)
    assert cfg.run.log_interval == 2000
    assert cfg.parallel.cpu_offload  # the template offloads optimizer and parameters to the CPU


# ------------------------------------------------------------------------------- real configs
REAL = DATA / "real"
# the world size each file is written for, where 8 does not divide its batch
REAL_WORLD = {
    "deepspeed_megatron_gpt2_scheduler.json": 4,
    "deepspeed_megatron_gpt2_zero2_offload.json": 4,
    "megatron_ds_universal_checkpointing.json": 1,
}
REAL_REFUSED = {
    "dsexamples_bing_bert_lamb_seq128.json": "optimizer.type=Lamb: seektrain trains with AdamW, and Lamb "
    "updates the weights differently",
    "dsexamples_bing_bert_pld_seq128.json": "progressive_layer_drop is on: it skips layers at random",
    "dsexamples_random_ltd.json": "data_efficiency is on: curriculum sampling and random-LTD change the data",
}


def _autos(block: dict, where: str = ""):
    for key, value in block.items():
        dotted = f"{where}.{key}" if where else key
        if value == "auto":
            yield dotted
        elif isinstance(value, dict):
            yield from _autos(value, dotted)


def test_every_collected_config_converts_or_is_refused_with_its_reason():
    files = sorted(REAL.glob("*.json"))
    sources = (REAL / "SOURCES.md").read_text()
    assert len(files) >= 20
    for path in files:
        assert f"`{path.name}`" in sources, path.name  # each file names its repository, path and commit
        world = REAL_WORLD.get(path.name, 8)
        if path.name in REAL_REFUSED:
            with pytest.raises(ConfigError) as err:
                load_config_with_deepspeed(path, world_size=world)
            assert REAL_REFUSED[path.name] in str(err.value) and "\n" not in str(err.value)
            continue
        cfg, out = load_config_with_deepspeed(path, world_size=world)
        assert isinstance(cfg, JobConfig)
        ds = json.loads(path.read_text())
        said = "\n".join([*out.notes, *(src for _, _, src in out.settings)])
        for key in ds:  # every top-level key is mapped or noted: none vanishes
            assert re.search(rf"(^|[\s(,]){re.escape(key)}\b", said, re.M), (path.name, key)
        for dotted in _autos(ds):  # every "auto" says what stands in for it
            assert f"{dotted}=auto -> " in said, (path.name, dotted)


def test_llama_factory_z3_golden():
    out = map_deepspeed(json.loads((REAL / "llamafactory_ds_z3_config.json").read_text()), None, 8)
    assert [(k, v) for k, v, _ in out.settings] == [
        ("parallel.data_parallel", "fsdp"),
        ("parallel.reshard_after_forward", True),
    ]
    notes = out.notes
    assert notes[0].startswith("zero_optimization: overlap_comm, contiguous_gradients, sub_group_size")
    assert "FSDP2 schedules its per-block all-gathers" in notes[0]
    assert notes[1:] == [
        "zero_allow_untested_optimizer=true: lets ZeRO wrap an optimizer DeepSpeed has not tested; "
        "seektrain's FSDP trains its own AdamW; ignored",
        "train_batch_size=auto -> 16 (train.global_batch_size, seektrain's default)",
        "train_micro_batch_size_per_gpu=auto -> 8 (train.micro_batch_size, seektrain's default)",
        "gradient_accumulation_steps=auto -> seektrain derives it from train.global_batch_size, "
        "micro_batch_size and the data-parallel size",
        "gradient_clipping=auto -> 1.0 (train.grad_clip, seektrain's default)",
        'fp16.enabled=auto -> "auto" (precision.dtype, seektrain\'s default)',
        'bf16.enabled=auto -> "auto" (precision.dtype, seektrain\'s default)',
        "zero_optimization.reduce_bucket_size=auto -> nothing to fill in (the key is ignored, see its note)",
        "zero_optimization.stage3_prefetch_bucket_size=auto -> nothing to fill in (the key is ignored, "
        "see its note)",
        "zero_optimization.stage3_param_persistence_threshold=auto -> nothing to fill in (the key is "
        "ignored, see its note)",
    ]


def test_an_all_auto_hugging_face_template_says_it_trains_on_our_values():
    path = REAL / "accelerate_zero_stage3_offload_config.json"
    out = map_deepspeed(json.loads(path.read_text()), None, 8)
    for line in (
        "optimizer.params.lr=auto -> 0.003 (optim.lr, seektrain's default)",
        "scheduler.params.warmup_max_lr=auto -> 0.003 (optim.lr, seektrain's default)",
        "scheduler.params.warmup_num_steps=auto -> 30 (optim.warmup_steps, seektrain's default)",
        "scheduler.params.total_num_steps=auto -> 300 (train.steps, seektrain's default)",
        "optimizer.params.weight_decay=auto -> 0.1 (optim.weight_decay, seektrain's default)",
        "train_micro_batch_size_per_gpu=auto -> 8 (train.micro_batch_size, from DeepSpeed "
        "gradient_accumulation_steps=1, train.micro_batch_size=8)",
    ):
        assert line in out.notes, line
    # the user's --set and the TOML config are named as the source when they set the value
    base = load_config(None, ["optim.lr=0.02"])
    out = map_deepspeed(json.loads(path.read_text()), base, 8, ["optim.weight_decay=0.05"])
    assert "optimizer.params.lr=auto -> 0.02 (optim.lr, from --config)" in out.notes
    assert "optimizer.params.weight_decay=auto -> 0.05 (optim.weight_decay, from --set)" in out.notes


def test_stage_0_golden_notes_fit_ddp():
    out = map_deepspeed(json.loads((REAL / "llamafactory_ds_z0_config.json").read_text()), None, 8)
    assert {k: v for k, v, _ in out.settings} == {
        "parallel.data_parallel": "ddp",
        "parallel.dp_shard": 1,
        "parallel.dp_replicate": 8,
    }
    notes = "\n".join(out.notes)
    assert "DDP buckets its gradient all-reduces itself during backward, so they are ignored" in notes
    assert "FSDP" not in notes.replace("seektrain's FSDP trains", "")  # nothing about all-gathers


def test_tensor_parallel_expert_parallel_and_ulysses_degrees():
    got, _ = mapped(json.loads((REAL / "llamafactory_ds_z2_autotp_config.json").read_text()), 8)
    assert got["parallel.tp"] == 2
    got, notes = mapped(
        {
            "train_micro_batch_size_per_gpu": 2,
            "tensor_parallel": {"autotp_size": 4},
            "sequence_parallel_size": 2,
        },
        world_size=16,
    )
    assert (got["parallel.tp"], got["parallel.cp"], got["train.global_batch_size"]) == (4, 2, 4)
    assert "world size 16 / (tp 4 × pp 1 × cp 2)" in notes
    got, notes = mapped({"expert_parallel": {"enabled": True, "autoep_size": 4, "route_scale": 2.5}})
    assert got["parallel.ep"] == 4 and "expert_parallel: route_scale steer DeepSpeed's AutoEP" in notes
    assert "parallel.ep" not in mapped({"expert_parallel": {"autoep_size": 4}})[0]


def test_monitor_config_and_top_level_monitors_map_to_trackers():
    got, notes = mapped(
        {
            "monitor_config": {
                "enabled": True,
                "tag": "x",
                "wandb": {"enabled": True, "project": "p"},
                "tensorboard": {"enabled": False},
                "comet": {"enabled": True},
            }
        }
    )
    assert got == {
        "metrics.trackers": ["wandb"],
        "metrics.tracker_project": "p",
        "metrics.tensorboard": False,
    }
    assert "monitor_config.comet.enabled=true: seektrain has no Comet tracker" in notes
    got, _ = mapped({"wandb": {"enabled": True}, "tensorboard": {"enabled": True}})
    assert got == {"metrics.trackers": ["wandb"], "metrics.tensorboard": True}


def test_block_names_and_sources_are_as_written():
    out = map_deepspeed({"bfloat16": {"enabled": True, "bf16_optimizer_states": True}})
    assert out.sources()["precision.dtype"] == "fp16.enabled=false, bfloat16.enabled=true"
    assert any(n.startswith("bfloat16.bf16_optimizer_states=true") for n in out.notes)
    assert "bfloat16.los" in one_line_error({"bfloat16": {"enabled": True, "los": 1}})
    out = map_deepspeed(
        json.loads((REAL / "deepspeed_megatron_gpt2_zero2_offload.json").read_text()), None, 4
    )
    assert out.sources()["parallel.cpu_offload"] == "zero_optimization.cpu_offload=true"
    out = map_deepspeed({"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}})
    assert out.sources()["precision.dtype"] == "fp16.enabled=false, bf16.enabled=true"


def test_every_noted_key_is_noted_and_every_refused_feature_refused_unless_disabled():
    from seektrain.config.deepspeed_keys import NOTED_KEYS, REFUSED_WHEN_ENABLED

    for key, why in NOTED_KEYS.items():
        _, notes = mapped({key: {}})
        assert f"{key}: {why}; ignored" in notes, key
    for key, (why, _) in REFUSED_WHEN_ENABLED.items():
        on = {"shared_parameters": {"enabled": True}} if key == "compression_training" else {"enabled": True}
        assert one_line_error({key: on}) == f"DeepSpeed key {key} is on: {why}", key
        _, notes = mapped({key: {"enabled": False}} if key != "compression_training" else {key: {}})
        assert f"{key}: not enabled, so DeepSpeed would not use it either; ignored" in notes, key
    assert "sparse_attention is on" in one_line_error({"sparse_attention": {"mode": "fixed"}})
    assert "gradient_allreduce_op=sum" in one_line_error({"gradient_allreduce_op": "sum"})
    got, _ = mapped({"communication_data_type": "bf16"})
    assert got == {"precision.reduce_dtype": "bf16"}
    assert "max_grad_norm" in one_line_error(
        {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}
    )


# ------------------------------------------------------------------------------- the CLI
def test_from_deepspeed_output_loads_back_equal(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 4,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2, "overlap_comm": True},
                "optimizer": {
                    "type": "AdamW",
                    "params": {"lr": 2e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
                },
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 800, "warmup_num_steps": 20},
                },
                "gradient_clipping": 1.0,
                "steps_per_print": 20,
                "tensorboard": {"enabled": True, "job_name": "x"},
            }
        )
    )
    args = ["config", "from-deepspeed", str(ds), "--world-size", "8", "--set", "run.dir=runs/ds"]
    assert main(args) == 0
    text = capsys.readouterr().out
    (tmp_path / "out.toml").write_text(text)
    expected, _ = load_config_with_deepspeed(ds, None, ["run.dir=runs/ds"], world_size=8)
    assert load_config(tmp_path / "out.toml") == expected
    assert expected.train.steps == 800 and expected.parallel.reshard_after_forward is False
    assert "# from DeepSpeed zero_optimization.stage=2\nreshard_after_forward = false" in text
    assert (
        "# from DeepSpeed train_batch_size=64, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4\n"
        "global_batch_size = 64" in text
    )
    assert "# note: zero_optimization: overlap_comm tune DeepSpeed's own buckets" in text
    assert tomllib.loads(text)["run"]["dir"] == "runs/ds"  # --set comes last


def test_deepspeed_file_goes_over_the_toml_and_under_set(tmp_path):
    toml = tmp_path / "base.toml"
    toml.write_text("[optim]\nlr = 0.01\nwarmup_steps = 7\n[train]\ngrad_clip = 2.0\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_clipping": 0.3, "steps_per_print": 3}))
    cfg, _ = load_config_with_deepspeed(ds, toml, ["run.log_interval=9"])
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.grad_clip, cfg.run.log_interval) == (
        0.01,
        7,
        0.3,
        9,
    )


def test_later_set_of_tp_counts_in_the_batch_rule(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}))
    cfg, _ = load_config_with_deepspeed(ds, None, ["parallel.tp=2"], world_size=8)
    assert cfg.train.global_batch_size == 1 * 2 * 4


TINY = [
    "train.seq_len=64",
    "checkpoint.interval=0",
    "run.progress_bar=false",
    "metrics.tensorboard=false",
    "train.eval_interval=0",
    "model.preset=tiny-v3",
    "train.steps=2",
]


def train_with(tmp_path: Path, ds: dict, nproc: int = 1):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    run = tmp_path / "run"
    args = ["train", "--deepspeed", str(path), "--nproc-per-node", str(nproc), "--set", f"run.dir={run}"]
    for item in TINY:
        args += ["--set", item]
    proc = seektrain(*args, timeout=600)
    return proc, run, tomllib.loads((run / "config.toml").read_text())


def test_train_with_a_deepspeed_config(tmp_path):
    proc, run, cfg = train_with(
        tmp_path,
        {
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}},
            "gradient_clipping": 0.5,
            "steps_per_print": 1,
        },
    )
    assert [m["step"] for m in metrics(run)] == [1, 2]
    assert cfg["train"]["global_batch_size"] == 4 and cfg["train"]["grad_clip"] == 0.5
    assert cfg["precision"]["dtype"] == "fp32" and cfg["optim"]["min_lr_ratio"] == 1.0
    assert [m["lr"] for m in metrics(run)] == pytest.approx([5e-4, 1e-3])  # linear warmup, then constant
    assert "seektrain: deepspeed: batch: 4 sequences per step" in proc.stderr


def test_train_with_deepspeed_uses_the_launch_world_size(tmp_path):
    proc, run, cfg = train_with(
        tmp_path,
        {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": False}},
        nproc=2,
    )
    assert cfg["train"]["global_batch_size"] == 1 * 2 * 2
    assert [m["step"] for m in metrics(run)] == [1, 2]
    assert proc.stderr.count("seektrain: deepspeed: batch:") == 1  # the launcher's, not every worker's


def test_docs_table_names_every_deepspeed_key():
    section = (ROOT / "docs" / "configuration.md").read_text().split("## From DeepSpeed")[1].split("\n## ")[0]
    for key in TOP_LEVEL_KEYS:
        assert re.search(rf"`{key}[`.]", section), key
