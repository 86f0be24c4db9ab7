"""What ``seektrain plan`` prints under "as --set" and "as TOML" is read back by the real config loader to the
layout it picked, for every preset (a pasted plan must start the run it describes)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tomllib

import pytest

from seektrain.config.loader import load_config
from seektrain.config.toml_values import set_value, toml_value
from seektrain.plan.report import set_lines, toml_text
from seektrain.plan.search import Candidate

# (preset, GPUs, extra --set): a GPU count each fits on; the searches of the larger MoE releases with LoRA
# take half a minute each on this machine and run with `make test-slow`.
FAST = [
    ("tiny-dense", 2, []),
    ("tiny-v2", 2, []),
    ("tiny-v3", 4, []),
    ("small-v3", 8, []),
    ("small-v3-sparse", 8, []),
    ("deepseek-llm-7b", 8, []),
    ("deepseek-llm-67b", 8, []),
    ("deepseek-v2-lite", 8, []),
]
SLOW = [("deepseek-v2", 8, ["lora.enabled=true"]), ("deepseek-v3", 8, ["lora.enabled=true"])]
CASES = FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW]


def _loaded_value(job, key: str):
    section, name = key.split(".")
    return getattr(getattr(job, section), name)


def _check_reads_back(settings: dict, toml: str, set_text: str, tmp_path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(toml, encoding="utf-8")
    tomllib.loads(toml)  # a TOML error here names the line and column
    from_toml = load_config(path)
    words = shlex.split(set_text)
    assert words[::2] == ["--set"] * len(settings), set_text
    from_set = load_config(None, words[1::2])
    for key, value in settings.items():
        assert _loaded_value(from_toml, key) == value, (key, value, toml)
        assert _loaded_value(from_set, key) == value, (key, value, set_text)


def test_every_value_type_reads_back(tmp_path):
    settings = {
        "parallel.tp": 2,
        "parallel.cpu_offload": False,
        "parallel.pp_split": [3, 5],
        "train.activation_checkpoint": "every:2",
        "optim.lr": 3e-05,
        "model.preset": "tiny-v3",
        "run.dir": "runs/a dir with spaces/$HOME",
    }
    cand = Candidate(settings)
    toml = toml_text(cand)
    assert "cpu_offload = false" in toml, toml
    _check_reads_back(settings, toml, set_lines(cand), tmp_path)
    settings["parallel.cpu_offload"] = True
    _check_reads_back(settings, toml_text(cand), set_lines(cand), tmp_path)


def test_writers_refuse_what_a_config_cannot_hold():
    with pytest.raises(TypeError, match="no TOML form"):
        toml_value(None)
    assert set_value([1, 2]) == "1,2" and toml_value([1, 2]) == "[1, 2]"


@pytest.mark.parametrize(("preset", "gpus", "extra"), CASES, ids=lambda v: str(v))
def test_printed_plan_reads_back_to_the_pick(preset, gpus, extra, tmp_path):
    cmd = [sys.executable, "-m", "seektrain.cli.main", "plan", "--model", preset, "--gpu", "h100-80g"]
    cmd += ["--gpus", str(gpus), "--json", *(a for s in extra for a in ("--set", s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    settings = plan["ranked"][0]["settings"]
    _check_reads_back(settings, plan["toml"], plan["set"], tmp_path)
    if preset == "tiny-dense":  # the human-readable output prints the same two blocks
        extra_args = [a for s in extra for a in ("--set", s)]
        text = subprocess.run(cmd[: cmd.index("--json")] + extra_args, capture_output=True, text=True).stdout
        assert plan["set"] in text and plan["toml"] in text
