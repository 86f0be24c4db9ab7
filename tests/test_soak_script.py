"""``benchmarks/soak_kills.py`` itself: a short soak (8 steps, one SIGKILL of a random rank, torchrun's
restart) passes, and its comparison (run here in-process) catches the smallest differences planted in
copies of the runs it kept: one ulp in one parameter of the final checkpoint, a step whose first
computation (before a restart) differs by one ulp from its recomputation, and one ulp in the
uninterrupted run's loss. The long soak itself is not run in CI; its record is in docs/checkpoints.md
("Soak")."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "soak_kills.py"


def script_module():
    """The script as a module, so that its comparison runs in this process (no new interpreter)."""
    spec = importlib.util.spec_from_file_location("soak_kills", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compared(capsys, soak_dir: Path, reference: Path) -> str:
    """What ``soak_kills.py --compare SOAK REFERENCE`` prints; it must exit 1 (a difference)."""
    assert script_module().main(["--compare", str(soak_dir), str(reference)]) == 1
    out = capsys.readouterr().out
    assert "soak: FAIL" in out, out
    return out


def soak(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def soaked(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("soak")
    proc = soak(
        *("--steps", "8", "--kill-every", "2", "--max-kills", "1", "--seed", "3"),
        *("--sigterm-share", "0", "--startup-share", "0", "--run-dir", str(root)),
        *("--set", "checkpoint.interval=2"),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "soak: PASS" in proc.stdout
    return root


def next_ulp(x: float) -> float:
    return torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(float("inf"))).item()


def test_a_killed_and_restarted_run_passes(soaked):
    summary = json.loads((soaked / "soak.json").read_text())
    figures = summary["figures"]
    assert figures["kills"] == 1 and figures["restarts"] == 1 and figures["relaunches"] == 0, figures
    assert summary["kills"][0]["signal"] == "SIGKILL" and summary["kills"][0]["after_step"] >= 1
    assert figures["tensors"] > 0 and figures["tensors_differing"] == 0 and figures["loss_max_abs_diff"] == 0


def copies(soaked: Path, tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "soak", tmp_path / "reference"
    shutil.copytree(soaked / "soak", a)
    shutil.copytree(soaked / "reference", b)
    return a, b


def test_one_ulp_in_one_parameter_fails(soaked, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from seektrain.checkpoint.export import read_all_tensors

    a, b = copies(soaked, tmp_path)
    ckpt = a / "checkpoints" / "step-00000008"
    state = read_all_tensors(ckpt)
    name = next(k for k in state if k.startswith("model.") and "experts" in k)
    state[name].view(-1)[0] = next_ulp(state[name].view(-1)[0].item())
    for f in ckpt.glob("*.distcp"):
        f.unlink()
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    out = compared(capsys, a, b)
    assert f"1 of {len(state)} tensors differ bit-wise, e.g. ['{name}']" in out, out


def test_one_ulp_in_a_loss_fails(soaked, tmp_path, capsys):
    a, b = copies(soaked, tmp_path)
    records = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    at = next(i for i, r in enumerate(records) if r["step"] == 4)
    first = {**records[at], "loss": next_ulp(records[at]["loss"])}  # a computation before a restart,
    records.insert(at, first)  # which the step's last (compared) computation does not repeat
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ref = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    ref[0]["loss"] = next_ulp(ref[0]["loss"])
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ref))
    out = compared(capsys, a, b)
    assert "step 4 recomputed after a restart differs from its first computation: ['loss']" in out, out
    assert "step 1 differs from the uninterrupted run: ['loss']" in out, out
    assert "tensors_differing    0" in out, out  # only the losses were planted
