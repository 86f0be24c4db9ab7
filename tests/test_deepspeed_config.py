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
from seektrain.models.presets import get_preset
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
    assert "world size 6 is not divisible by parallel.tp × parallel.pp = 4×1" in one_line_error(
        {**ds, "tensor_model_parallel_size": 4}, world_size=6
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
    assert message.startswith(
        "unknown DeepSpeed key zero_optimization.overlap_com; keys seektrain knows in "
        "zero_optimization: stage, offload_optimizer"
    )
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
        "csv_monitor: seektrain writes every step's metrics to run.dir/metrics.jsonl",
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


def test_unknown_top_level_key_lists_the_keys_we_know():
    message = one_line_error({"train_batch_size": 8, "amp": {"enabled": True}})
    assert message == f"unknown DeepSpeed key amp; keys seektrain knows: {', '.join(TOP_LEVEL_KEYS)}"


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
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"seektrain: error: {bad}: unknown DeepSpeed key fp16.los_scale; keys seektrain knows in fp16: enabled,"
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
