"""MFU never exceeds 100%: a probe slower than the model (as on an AVX2 CPU in bf16, where the log once
said ``mfu 348%``) raises the peak to the achieved rate (``MfuMeter``), and the probe itself measures the
run's dtype at the model's own matmul shapes."""

from __future__ import annotations

import torch

from seektrain.config.loader import load_config
from seektrain.models.deepseek.presets import get_preset
from seektrain.observe import flops
from seektrain.observe.flops import MfuMeter, model_matmul_shapes, peak_flops
from seektrain.plan.run_plan import RunPlan
from seektrain.train import monitor as monitor_mod
from seektrain.train.monitor import RunMonitor


def test_a_step_faster_than_the_peak_raises_it():
    meter = MfuMeter(1e9, "measured matmul probe on cpu", flops_per_token=1e6)
    assert meter(1, 500.0) == 0.5  # 5e8 of 1e9
    assert meter(2, 4000.0) == 1.0  # 4e9 achieved > 1e9 probed: the peak is what was achieved
    assert meter.peak == 4e9 and "raised to the 4 GFLOP/s step 2 achieved" in meter.source
    assert meter(3, 2000.0) == 0.5  # measured against the raised peak from now on
    meter(4, 8000.0)
    assert meter.source.count("raised") == 1 and "step 4" in meter.source


def test_the_monitor_reports_at_most_100_percent_with_a_slow_probe(tmp_path, monkeypatch):
    """The trainer's own path (RunMonitor.log -> metrics.jsonl and summary.json) with a probe injected
    that is 1000x slower than the steps."""
    job = load_config(None, ["metrics.tensorboard=false", "run.progress_bar=false", f"run.dir={tmp_path}"])
    plan = RunPlan.resolve(job, get_preset("tiny-v3"), 1, "cpu")
    per_token = flops.model_flops_per_token(plan.model, job.train.seq_len)
    step_s = 0.5
    achieved = plan.tokens_per_step / step_s * per_token
    monkeypatch.setattr(monitor_mod, "peak_flops", lambda *a, **k: (achieved / 1000, "slow probe"))
    mon = RunMonitor(plan, tmp_path, 0, 0, torch.device("cpu"), 0, resumed=False)
    try:
        for step, seconds in enumerate((step_s, step_s * 2, step_s / 2), start=1):
            mon.log(step, {"loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": seconds})
        one_process = {
            "data_parallel": "none",
            "shard_group_size": 1,
            "replicate_group_size": 1,
            "tp": 1,
            "ep": 1,
            "pp_stages": [0],
        }
        summary = mon.summarise(3.0, 1, one_process)
    finally:
        mon.close()
    got = [r["mfu"] for r in mon.records]
    assert max(got) <= 1.0 and got[0] == 1.0 and got[1] == 0.5 and got[2] == 1.0
    assert summary["mfu_mean"] <= 1.0 and "raised" in summary["device_flops_source"]


def test_the_probe_measures_the_given_shapes_in_the_given_dtype():
    shapes = model_matmul_shapes(get_preset("small-v3"), 2048)
    assert (2048, 512, 32000) in shapes and (2048, 512, 1536) in shapes  # LM head, dense MLP
    flops._probe.cache_clear()
    peak, source = peak_flops("cpu", torch.float32, probe_seconds=0.1, shapes=((64, 64, 64),))
    assert peak > 0 and "float32, best of 2 matmul shapes" in source
    assert flops._probe.cache_info().currsize == 1
