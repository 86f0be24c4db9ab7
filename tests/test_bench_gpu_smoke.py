"""``benchmarks/bench_gpu.py --smoke`` runs every row of the GPU benchmark on the CPU with tiny shapes:
each row either measured (positive tokens/s, or a checkpoint stall) or says why it was skipped, nothing
failed, and the JSON file holds the figures, versions, device and commit the docs promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_ROWS = ("eager", "compiled", "transformers", "trainer_bf16", "trainer_fp8")


def test_smoke_run_measures_or_explains_every_row(tmp_path):
    out = tmp_path / "bench_gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_gpu.py"),
            "--smoke",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())

    assert data["smoke"] is True
    assert (
        data["device"]["type"] == "cpu" and data["device"]["name"] and data["device"]["peak_bf16_flops"] > 0
    )
    for package in ("torch", "transformers", "torchao"):
        assert package in data["versions"]
    assert data["versions"]["torch"] and data["versions"]["transformers"]
    assert data["commit"]["sha"], data["commit"]  # this checkout is a git repository
    assert data["settings"]["tokens_per_step"] == data["settings"]["batch"] * data["settings"]["seq"]

    for model in ("dense", "moe"):
        facts = data["models"][model]
        assert facts["params_total"] > facts["params_active"] > 0 and facts["flops_per_token"] > 0
        rows = data["rows"][model]
        assert set(MODEL_ROWS) <= set(rows), rows.keys()
        for name in MODEL_ROWS:
            row = rows[name]
            assert not row.get("error"), (model, name, row)
            if row.get("skipped"):
                assert name == "trainer_fp8", (model, name, row)  # the only row a CPU may not run
                continue
            assert row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["peak_mem_gib"] > 0, (model, name, row)
            assert len(row["step_s"]) == data["settings"]["iters"]
        assert (
            rows["compiled"]["compile_s"] > 0
            and rows["compiled"]["compiled_blocks"] == facts["config"]["num_hidden_layers"]
        )
        assert rows["transformers"]["logits_max_abs_diff_fp32"] < 1e-3
        assert rows["trainer_bf16"]["ended"].startswith(("stopped after its last step", "exited"))
        assert rows["trainer_bf16"]["loss_last"] > 0

    for name in ("ckpt_sync", "ckpt_async"):
        row = data["rows"]["dense"][name]
        assert not row.get("error") and not row.get("skipped"), row
        assert row["stall_s"] > 0 and row["bytes_written"] > row["state_bytes"] > 0
    assert data["rows"]["dense"]["ckpt_async"]["background_s"] >= 0
    assert set(data["comparisons"]) >= {"dense", "moe", "checkpoint"}

    # the markdown report: one line per row, both models side by side
    assert "SMOKE RUN ON A CPU" in proc.stdout
    for title in (r["title"] for r in data["rows"]["dense"].values()):
        assert f"| {title} |" in proc.stdout
    assert "dense" in proc.stdout and "moe" in proc.stdout
