"""The config as users meet it: `--version`, `config keys` generated from the schema (every key with
help, and docs/configuration.md in step with it), the new keys' validation and the renamed-key table."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from run_cli import seektrain
from seektrain import version as version_mod
from seektrain.config.loader import RENAMED_KEYS, ConfigError, leaf_keys, load_config
from seektrain.config.reference import config_keys, format_keys
from seektrain.config.schema import JobConfig

ROOT = Path(__file__).resolve().parent.parent


def all_keys() -> list[str]:
    return [key for key, _, _ in leaf_keys(JobConfig())]


def test_the_cli_and_its_config_commands_do_not_import_torch():
    """`seektrain --help`, `config keys` and the launchers' parser answer in a fraction of a second: torch
    (2-4 s to import, more with torch._dynamo) is imported by the commands that run a model, not by the
    parser that lists them all (a command module importing it at the top costs every `seektrain` call)."""
    import subprocess
    import sys

    probe = (
        "import sys; from seektrain.cli.main import build_parser, main; build_parser(); "
        "main(['config', 'keys']); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_version_flag_prints_the_package_version():
    out = seektrain("--version").stdout.strip()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert re.fullmatch(r"seektrain \d+\.\d+\.\d+\S*", out), out
    assert out == f"seektrain {version_mod.version()}"
    assert version_mod.source_version() == pyproject


def test_version_falls_back_to_the_source_tree_when_not_installed(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version_mod.metadata, "version", not_installed)
    fake = tmp_path / "pyproject.toml"
    fake.write_text('[project]\nname = "seektrain"\nversion = "9.8.7"\n')
    monkeypatch.setattr(version_mod, "PYPROJECT", fake)
    assert version_mod.version() == "9.8.7"
    monkeypatch.setattr(version_mod, "PYPROJECT", tmp_path / "absent.toml")
    assert version_mod.version() == "unknown"


def test_every_field_has_one_line_of_help():
    for key, _, f in leaf_keys(JobConfig()):  # sub-tables' keys too
        text = f.metadata.get("help", "")
        assert text and "\n" not in text and len(text) <= 120, f"{key}: {text!r}"


def test_config_keys_lists_every_key_with_type_default_range_and_help():
    out = seektrain("config", "keys").stdout.splitlines()
    assert len(out) == len(all_keys())
    by_key = {line.split()[0]: line for line in out}
    assert set(by_key) == set(all_keys())
    assert re.fullmatch(r"train\.steps\s+int\s+300\s+>= 1\s+total optimizer steps .*", by_key["train.steps"])
    assert re.fullmatch(
        r'checkpoint\.resume\s+str\s+"auto"\s+not empty\s+auto .*', by_key["checkpoint.resume"]
    )
    assert re.fullmatch(
        r"metrics\.trackers\s+list\[str\]\s+\[\]\s+wandb \| mlflow\s+experiment trackers.*",
        by_key["metrics.trackers"],
    )
    assert re.fullmatch(r"optim\.lr\s+float\s+0\.003\s+> 0\s+peak .*", by_key["optim.lr"])
    assert re.fullmatch(r"parallel\.dp_shard\s+int\s+-1\s+>= 1 or -1\s+FSDP .*", by_key["parallel.dp_shard"])
    assert re.fullmatch(
        r"cpu\.keep_freed_memory\s+bool\s+true\s+glibc keeps .*", by_key["cpu.keep_freed_memory"]
    )


def test_docs_configuration_holds_the_generated_table():
    """docs/configuration.md carries `seektrain config keys --markdown` verbatim, so it cannot drift."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    table = format_keys(config_keys(), markdown=True)
    assert table in doc, "regenerate the table: seektrain config keys --markdown"
    assert seektrain("config", "keys", "--markdown").stdout == table


def test_new_keys_defaults_and_round_trip():
    cfg = load_config(
        overrides=[
            "checkpoint.resume=120",
            "train.eval_interval=0",
            "metrics.trackers=[]",
            "cpu.keep_freed_memory=false",
        ]
    )
    assert (cfg.checkpoint.resume, cfg.train.eval_interval, cfg.train.eval_steps) == ("120", 0, 4)
    assert cfg.metrics.trackers == [] and cfg.cpu.keep_freed_memory is False
    d = JobConfig()
    assert (d.checkpoint.resume, d.train.eval_interval, d.metrics.tracker_project) == (
        "auto",
        100,
        "seektrain",
    )


@pytest.mark.parametrize(
    "spec", ["auto", "never", "0", "2000", "runs/x/checkpoints/step-00000100", "/abs/path"]
)
def test_resume_forms_accepted(spec):
    assert load_config(overrides=[f"checkpoint.resume={spec}"]).checkpoint.resume == spec


def test_resume_existing_relative_path_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "step-00000010").mkdir()
    assert load_config(overrides=["checkpoint.resume=step-00000010"]).checkpoint.resume == "step-00000010"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["checkpoint.resume=latest"],
            "checkpoint.resume='latest': use auto, never, a step number or a checkpoint path",
        ),
        (["checkpoint.resume=-3"], "checkpoint.resume='-3'"),
        (["checkpoint.resume="], "checkpoint.resume=''"),
        (["train.eval_interval=-1"], "train.eval_interval=-1: must be >= 0"),
        (["train.eval_steps=0"], "train.eval_steps=0: must be >= 1"),
        (
            ["train.cpu_keep_freed_memory=false"],
            "config key 'train.cpu_keep_freed_memory' moved to 'cpu.keep_freed_memory'",
        ),
    ],
)
def test_bad_new_keys_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_renamed_key_in_a_toml_file(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[train]\nsteps = 3\ncpu_keep_freed_memory = true\n")
    with pytest.raises(ConfigError, match="moved to 'cpu.keep_freed_memory'"):
        load_config(path)
    for old, new in RENAMED_KEYS.items():
        assert old not in all_keys() and new in all_keys()


def test_cli_prints_the_rename_as_one_line():
    proc = seektrain("config", "show", "--set", "train.cpu_keep_freed_memory=false", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "seektrain: error: config key 'train.cpu_keep_freed_memory' moved to "
        "'cpu.keep_freed_memory'; rename it in your config or --set"
    )
