"""The example configs in configs/: each validates (`config show`), each is a valid layout at the world
size it is written for, `default.toml` is the built-in default, and the smoke command written in each
file's header works here; the V3 one is trained for 2 steps."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from run_cli import metrics, seektrain
from seektrain.config.loader import config_to_toml, load_config
from seektrain.config.schema import JobConfig
from seektrain.launch.preflight import check_layout

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# The world size each example is written for (the GPUs its header names).
WORLD = {
    "default.toml": 2,
    "deepseek-llm-7b-8gpu.toml": 8,
    "deepseek-llm-67b-8x8gpu.toml": 64,
    "deepseek-v2-lite-1node.toml": 8,
    "deepseek-v3-256nodes.toml": 2048,
    "deepseek-v2-lite-sft-8gpu.toml": 8,
    "deepseek-v2-lite-32k.toml": 8,
    "deepseek-v3-lora-8gpu.toml": 8,
}
PRESET = {
    "deepseek-llm-7b-8gpu.toml": "deepseek-llm-7b",
    "deepseek-llm-67b-8x8gpu.toml": "deepseek-llm-67b",
    "deepseek-v2-lite-1node.toml": "deepseek-v2-lite",
    "deepseek-v3-256nodes.toml": "deepseek-v3",
    "deepseek-v2-lite-sft-8gpu.toml": "deepseek-v2-lite",
    "deepseek-v2-lite-32k.toml": "deepseek-v2-lite",
    "deepseek-v3-lora-8gpu.toml": "deepseek-v3",
}


def smoke_args(path: Path, run_dir: Path) -> list[str]:
    """The arguments of the `seektrain train` smoke command in the file's header comment."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Smoke test"))
    command = ""
    for line in lines[start + 1 :]:
        command += " " + line.removeprefix("#").strip().removesuffix("\\")
        if not line.endswith("\\"):
            break
    args = shlex.split(command)
    assert args[:2] == ["seektrain", "train"], command
    return [a if not a.startswith("run.dir=") else f"run.dir={run_dir}" for a in args[2:]]


def test_every_example_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.toml")) == sorted(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_config_show_validates(name):
    out = seektrain("config", "show", "--config", str(CONFIGS / name)).stdout
    assert load_config(CONFIGS / name) == load_config_from_text(out)
    # A fine-tuning example names the release (model.hf_path), not downloaded here; its preset is the
    # same architecture, and the layout is checked on that.
    cfg = load_config(CONFIGS / name, ["model.hf_path="])
    check_layout(cfg, WORLD[name])  # degrees, heads, experts and pipeline split fit that world size
    if name in PRESET:
        assert cfg.model.preset == PRESET[name] and cfg.precision.dtype == "bf16"
        assert cfg.train.activation_checkpoint != "none"


def load_config_from_text(text: str):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(text)
    try:
        return load_config(fh.name)
    finally:
        Path(fh.name).unlink()


def test_default_is_the_built_in_default():
    text = (CONFIGS / "default.toml").read_text()
    assert load_config(CONFIGS / "default.toml") == JobConfig()
    body = text[text.index("\n[") :].lstrip("\n")  # after the header comment
    assert body == config_to_toml(JobConfig(), comments=True), "regenerate: seektrain config show --comments"


@pytest.mark.parametrize("name", sorted(PRESET))
def test_smoke_command_in_the_header_validates_for_one_process(name, tmp_path):
    args = smoke_args(CONFIGS / name, tmp_path / "run")
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    cfg = load_config(CONFIGS / name, overrides)
    assert cfg.model.preset.startswith("tiny-") and cfg.train.steps == 2
    check_layout(cfg, 1)


def test_v3_example_trains_two_steps_with_tiny_v3(tmp_path):
    run = tmp_path / "run"
    args = smoke_args(CONFIGS / "deepseek-v3-256nodes.toml", run)
    seektrain(
        "train", *args, "--set", "run.progress_bar=false", "--set", "metrics.prometheus_port=0", timeout=600
    )
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2] and "mtp_loss" in records[-1]
    assert (run / "checkpoints" / "step-00000002").is_dir()
