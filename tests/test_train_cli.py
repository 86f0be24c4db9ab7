"""The training command end to end: the default run learns, fp16 overflow steps are skipped, sampling
works, and bad input is refused with one line."""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

from run_cli import losses, metrics, seektrain, train
from seektrain.platform.compute_dtype import choose_dtype
from seektrain.train.precision import DynamicLossScaler


def test_default_run_short_learns_and_samples(tmp_path):
    """The README's default (tiny-v3 with MLA + MoE + MTP on the built-in corpus, FSDP over 2 ranks),
    shortened: the loss falls well below its start and `sample` continues a prompt."""
    run = tmp_path / "default"
    seektrain(
        "train",
        "--nproc-per-node",
        "2",
        "--set",
        f"run.dir={run}",
        "--set",
        "train.steps=40",
        "--set",
        "optim.warmup_steps=5",
        "--set",
        "run.progress_bar=false",
        timeout=600,
    )
    values = losses(run)
    assert values[0] > math.log(320) - 0.5  # starts near ln(vocab)
    assert min(values[-5:]) < values[0] - 2.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens_per_s_mean"] > 0
    log = (run / "train.log").read_text()
    assert log.count("step 40/40") == 1
    assert choose_dtype("auto", "cpu").why in log  # precision.dtype=auto: which dtype and why, at start-up
    assert any((run / "tensorboard").iterdir())
    assert all(0 < r["mfu"] <= 1.0 for r in metrics(run)) and summary["mfu_mean"] <= 1.0
    record = metrics(run)[-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mtp_loss", "expert_imbalance"):
        assert key in record, key
    # per-layer MoE health, in metrics.jsonl and TensorBoard (Prometheus: test_observe_training_run.py):
    # layers 1-3 (layer 0 is dense) and the MTP block's, layer 4
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from seektrain.observe.names import LAYER_KEYS, layer_key

    per_layer = {layer_key(key, layer) for key in LAYER_KEYS for layer in (1, 2, 3, 4)}
    assert per_layer == {key for key in record if "/layer" in key}
    assert all(1 <= record[layer_key("moe_load_max_over_mean", layer)] <= 4 for layer in (1, 2, 3, 4))
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert per_layer <= set(events.Tags()["scalars"])
    out = seektrain("sample", "--run", str(run), "--prompt", "def ", "--max-new-tokens", "40")
    header, text = out.stdout.split("\n", 1)
    assert header.startswith("# ") and "step-00000040" in header
    assert text.startswith("def ") and len(text) > len("def ") + 20


def test_fp16_overflow_steps_are_skipped(tmp_path):
    """An absurd initial loss scale overflows fp16 gradients: those steps are skipped (no update), the
    scale halves each time, and training then proceeds."""
    train(
        tmp_path,
        "train.steps=14",
        "precision.dtype=fp16",
        "precision.loss_scale_init=1048576",
        "model.preset=tiny-dense",
    )
    recs = metrics(tmp_path)
    skipped = [r for r in recs if r["skipped"]]
    assert skipped and recs[0]["skipped"] == 1
    scales = [r["loss_scale"] for r in recs]
    assert scales[0] == 1048576 / 2 and all(b <= a for a, b in itertools.pairwise(scales[: len(skipped)]))
    assert recs[-1]["skipped"] == 0 and math.isfinite(recs[-1]["grad_norm"])


def test_loss_scaler_unit():
    """The overflow flag, the scale and the step counts are device tensors decided there (no host read)."""
    scaler = DynamicLossScaler(True, init_scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    overflow = scaler.unscale([p])
    assert isinstance(overflow, torch.Tensor) and overflow.dtype == torch.bool and bool(overflow)
    scaler.update(~overflow)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1 and scaler.good_steps == 0
    p.grad = torch.tensor([4.0, 8.0, 12.0])
    assert not scaler.unscale([p])
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    scaler.update(True, counted=False)  # a bad loss's step: the scaler is left alone
    assert scaler.scale == 4.0 and scaler.good_steps == 0
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 8.0 and scaler.good_steps == 2
    restored = DynamicLossScaler(True, init_scale=1.0, growth_interval=2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == {"scale": 8.0, "good_steps": 2, "skipped_steps": 1}
    assert DynamicLossScaler(False).unscale([p]) is None and DynamicLossScaler(False).scale_value == 1.0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "train.stepz=3"], "unknown config key 'train.stepz'"),
        (["--set", "train.steps=ten"], "train.steps: expected an integer"),
        (
            ["--set", "train.global_batch_size=6", "--set", "train.micro_batch_size=4"],
            "train.global_batch_size=6 is not a multiple of train.micro_batch_size=4",
        ),
        (
            [
                "--nproc-per-node",
                "2",
                "--set",
                "train.global_batch_size=2",
                "--set",
                "train.micro_batch_size=2",
            ],
            "data-parallel",
        ),
        (
            ["--nproc-per-node", "2", "--set", "parallel.tp=3", "--set", "parallel.dp_shard=1"],
            "world size is 2",
        ),
        (
            ["--nproc-per-node", "2", "--set", "parallel.data_parallel=ddp", "--set", "parallel.dp_shard=2"],
            "data_parallel=ddp",
        ),
        (["--config", "/nonexistent/x.toml"], "config file /nonexistent/x.toml not found"),
        (["--set", "data.path=/nonexistent/data"], "/nonexistent/data"),
        (["--set", "model.preset=gpt5"], "model.preset='gpt5' is unknown"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, needle):
    proc = seektrain("train", "--set", f"run.dir={tmp_path / 'r'}", *args, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert err and err[-1].startswith("seektrain: error:") and needle in err[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_bad_toml_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[train]\nsteps = \n")
    proc = seektrain("config", "show", "--config", str(cfg), check=False)
    assert proc.returncode == 2 and "is not valid TOML" in proc.stderr


def test_empty_data_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = seektrain(
        "train", "--set", f"run.dir={tmp_path / 'r'}", "--set", f"data.path={tmp_path / 'empty'}", check=False
    )
    assert proc.returncode == 2 and "manifest.json" in proc.stderr and "Traceback" not in proc.stderr


def test_models_json_lists_official_sizes():
    rows = {r["name"]: r for r in json.loads(seektrain("models", "--json").stdout)}
    v3 = rows["deepseek-v3"]
    assert round(v3["total_params"] / 1e9) == 671 and round(v3["active_params"] / 1e9) == 37
    assert round(rows["deepseek-v2"]["total_params"] / 1e9) == 236
    assert round(rows["deepseek-v2"]["active_params"] / 1e9) == 21
    assert {"deepseek-llm-7b", "deepseek-llm-67b", "deepseek-v2-lite", "tiny-v3", "small-v3"} <= set(rows)


@pytest.mark.parametrize("text", ["5,6", "5 6", "[5, 6]", "[5,6]"])
def test_list_override_accepts_toml_arrays(text):
    from seektrain.config.loader import load_config

    assert load_config(overrides=[f"profile.steps={text}"]).profile.steps == [5, 6]
    assert load_config(overrides=["profile.steps=[]"]).profile.steps == []


def test_an_in_process_run_leaves_no_torchrun_variables(tmp_path, monkeypatch):
    """A world of one sets RANK, MASTER_PORT, ... itself; after the run (here ended by bad data, after
    the process group started) they are gone again, so children this process starts later do not inherit
    a MASTER_PORT its own process group still listens on (they failed with EADDRINUSE)."""
    from seektrain.config.loader import load_config
    from seektrain.errors import UserError
    from seektrain.train.trainer import train as train_in_process

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"data.path={tmp_path / 'no-data'}"])
    with pytest.raises(UserError, match="no-data"):
        train_in_process(cfg)
    assert [name for name in names if name in os.environ] == []
