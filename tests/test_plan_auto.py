"""``parallel.auto = true``: a real 2-rank CPU run takes the planner's best layout for its world size,
logs why in one line, records the chosen degrees in config.toml, and trains."""

from __future__ import annotations

import tomllib

from run_cli import TINY, metrics, train
from seektrain.config.loader import load_config
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan.auto import auto_layout


def test_auto_layout_on_two_cpu_ranks(tmp_path):
    run = tmp_path / "run"
    proc = train(
        run, "parallel.auto=true", "model.preset=tiny-v3", "train.steps=2", "train.eval_interval=0", nproc=2
    )
    log = (run / "train.log").read_text()
    lines = [line for line in log.splitlines() if "parallel.auto:" in line]
    assert len(lines) == 1 and "predicted step" in lines[0] and "runner-up" in lines[0], proc.stdout[-2000:]
    expected, why = auto_layout(
        load_config(None, [*TINY, "parallel.auto=true", "model.preset=tiny-v3"]),
        get_preset("tiny-v3"),
        2,
        "cpu",
        2,
    )
    written = tomllib.loads((run / "config.toml").read_text())
    for key in ("tp", "pp", "dp_shard", "dp_replicate", "ep"):
        assert written["parallel"][key] == getattr(expected.parallel, key)
    assert written["train"]["micro_batch_size"] == expected.train.micro_batch_size
    assert why.split(" on ")[0] in lines[0]
    assert [m["step"] for m in metrics(run)] == [1, 2]


def test_auto_off_changes_nothing():
    job = load_config(None, ["parallel.tp=2"])
    same, why = auto_layout(job, get_preset("tiny-v3"), 2, "cpu", 2)
    assert same is job and why == ""
