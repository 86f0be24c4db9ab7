"""Run summary and advice, and memory/GPU stats that never fail."""

from __future__ import annotations

import json
import sys
import types
from collections import Counter
from types import SimpleNamespace

import torch

from seektrain.observe.memory_stats import GpuStats, gpu_stats, memory_stats
from seektrain.observe.summary import format_summary, write_summary


def records(n: int = 10, **overrides) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        record = {
            "step": i,
            "loss": 5.0 - 0.1 * i,
            "tokens_per_s": 1000.0,
            "mfu": 0.4,
            "step_time_s": 1.0,
            "data_wait_s": 0.02,
            "fwd_bwd_s": 0.8,
            "optim_s": 0.1,
            "comm_s": 0.0,
            "mem_peak_gib": 10.0 + i,
            "expert_imbalance": 1.1,
        }
        record.update({k: (v(i) if callable(v) else v) for k, v in overrides.items()})
        out.append(record)
    out[0]["tokens_per_s"] = 10.0  # warm-up step: compile, allocator growth
    return out


def test_summary_of_a_healthy_run(tmp_path):
    summary = write_summary(tmp_path, records(), {"model": "tiny", "device": "cuda:0"})
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["tokens_per_s_mean"] == 1000.0  # the warm-up steps are excluded
    assert abs(summary["mfu_mean"] - 0.4) < 1e-12 and summary["peak_mem_peak_gib"] == 20.0
    assert abs(summary["time_fractions"]["fwd_bwd_s"] - 0.8) < 1e-9
    assert abs(summary["time_fractions"]["other"] - 0.08) < 1e-9
    assert summary["advice"] == [] and summary["model"] == "tiny"
    text = format_summary(summary)
    assert "1,000 tokens/s" in text and "MFU          40.0%" in text and "advice" not in text


def test_checkpoint_stalls_are_summed_over_the_steps_that_logged_one(tmp_path):
    """Only steps that saved or committed a checkpoint carry the key; warm-up steps count too."""
    logged = records()
    for step, stall in ((2, 0.5), (4, 0.25), (8, 1.5)):
        logged[step - 1]["checkpoint_stall_s"] = stall
    summary = write_summary(tmp_path, logged)
    assert (summary["checkpoint_stalls"], summary["checkpoint_stall_s_max"]) == (3, 1.5)
    assert summary["checkpoint_stall_s_total"] == 2.25
    assert "checkpoints  training blocked 2.25 s in 3 steps, at most 1.50 s" in format_summary(summary)
    assert "checkpoint_stalls" not in write_summary(tmp_path, records())


def test_advice_for_numbers_that_look_wrong(tmp_path):
    bad = records(
        data_wait_s=0.3,
        expert_imbalance=lambda i: 1.0 + 0.1 * i,
        mfu=0.02,
        loss_scale=lambda i: 2.0 ** (16 - 2 * i),
    )
    summary = write_summary(tmp_path, bad, {"device": "cuda:0"})
    advice = "\n".join(summary["advice"])
    assert "data wait is 30%" in advice
    assert "expert imbalance reached 2.00" in advice
    assert "loss scale collapsed" in advice
    assert "MFU is only 2.0%" in advice
    assert format_summary(summary).count("advice:") == 4


def test_low_mfu_on_cpu_is_not_advice_and_empty_records_work(tmp_path):
    assert write_summary(tmp_path, records(mfu=0.001), {"device": "cpu"})["advice"] == []
    empty = write_summary(tmp_path, [], {})
    assert empty["steps"] == 0 and "run summary: 0 steps" in format_summary(empty)


def test_nan_loss_is_advice(tmp_path):
    run = records(loss=lambda i: float("nan") if i == 10 else 1.0)
    assert any("not finite" in line for line in write_summary(tmp_path, run, {})["advice"])


def test_memory_and_gpu_stats_never_fail():
    stats = memory_stats(torch.device("cpu"))
    assert 0 < stats["mem_rss_gib"] <= stats["mem_peak_rss_gib"] * 1.01
    assert isinstance(gpu_stats(), dict)  # {} on a machine without NVML or nvidia-smi
    if torch.cuda.is_available():
        assert {"mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib"} <= set(memory_stats("cuda"))


def _fake_nvml(calls: Counter) -> types.ModuleType:
    """A ``pynvml`` stand-in that counts initialisations, reads and shutdowns."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.nvmlInit = lambda: calls.update(["init"])
    nvml.nvmlShutdown = lambda: calls.update(["shutdown"])
    nvml.nvmlDeviceGetHandleByIndex = lambda index: ("gpu", index)
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: (calls.update(["read"]), SimpleNamespace(gpu=55))[1]
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: SimpleNamespace(used=2 * 2**30)
    nvml.nvmlDeviceGetPowerUsage = lambda handle: 300_000  # mW
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 60
    return nvml


def test_gpu_stats_start_nvml_once_per_run(monkeypatch):
    calls = Counter()
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(calls))
    stats = GpuStats(3)
    for _ in range(4):
        assert stats.sample() == {
            "gpu_util_pct": 55.0,
            "gpu_mem_used_gib": 2.0,
            "gpu_power_w": 300.0,
            "gpu_temp_c": 60.0,
        }
    stats.close()
    assert calls == {"init": 1, "read": 4, "shutdown": 1}
    assert gpu_stats(0)["gpu_util_pct"] == 55.0 and calls["init"] == calls["shutdown"] == 2


def test_monitor_samples_the_gpu_every_interval_steps(monkeypatch):
    """RunMonitor.after_step adds a GPU sample on every metrics.gpu_stats_interval-th step only (the
    monitor's other parts are stubbed: this checks the wiring, on a machine without a GPU)."""
    from seektrain.train.monitor import RunMonitor

    calls = Counter()
    monitor = object.__new__(RunMonitor)
    monitor.profiler, monitor.device, monitor._ended = None, torch.device("cpu"), {}
    monitor._all_to_all_at_start, monitor.all_to_all_per_step = 0, []
    monitor._hops_at_start, monitor.cp_hops_per_step = 0, []
    monitor.progress = SimpleNamespace(advance=lambda step: None)
    monitor.gpu, monitor.gpu_interval = (
        SimpleNamespace(sample=lambda: calls.update(["sample"]) or {"gpu_util_pct": 1.0}),
        10,
    )
    sampled = []
    for step in range(1, 26):
        values: dict = {}
        monitor.after_step(step, values)
        if "gpu_util_pct" in values:
            sampled.append(step)
        assert "mem_rss_gib" in values  # memory is read every step (host counters, no device wait)
    assert sampled == [10, 20] and calls["sample"] == 2


def test_the_layout_that_ran_gets_a_line(tmp_path):
    ran = {
        "mesh": {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1},
        "data_parallel": "fsdp",
        "shard_group_size": 2,
        "replicate_group_size": 1,
        "tp": 1,
        "ep": 2,
        "experts_per_rank": 4,
        "all_to_all_per_step": 20,
        "pp_stages": [0],
        "pp_schedule": None,
    }
    summary = write_summary(tmp_path, [{"step": 1, "loss": 2.0}], {"layout_ran": ran})
    assert json.loads((tmp_path / "summary.json").read_text())["layout_ran"] == ran
    assert (
        "layout ran   fsdp (shard 2, replicate 1), tp 1, ep 2 (4 experts per rank, 20 all-to-alls per step), "
        "pp stages [0]"
    ) in format_summary(summary)
