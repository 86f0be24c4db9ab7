"""A real training run watched from outside: its /metrics endpoint parses while it trains, a real
Prometheus server scrapes it and answers queries, `--set profile.steps=` writes a Chrome trace, and
`seektrain flops` prints the per-module breakdown."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from run_cli import TINY, seektrain, stop_process
from test_observe_prometheus import _get, free_port, require

REQUIRED = {
    "seektrain_step",
    "seektrain_loss",
    "seektrain_tokens_per_second",
    "seektrain_mfu",
    "seektrain_grad_norm",
    "seektrain_learning_rate",
}


def _start_training(run_dir: Path, port: int, steps: int) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "seektrain.cli.main",
        "train",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"metrics.prometheus_port={port}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "model.preset=tiny-v3",  # MoE: its per-layer gauges carry a layer label
    ]
    for item in TINY:
        args += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _scrape(port: int) -> dict[str, float]:
    """name -> value, and (name, layer) -> value for the per-layer MoE gauges."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return {s.name: s.value for s in samples} | {
        (s.name, s.labels["layer"]): s.value for s in samples if "layer" in s.labels
    }


def test_prometheus_scrapes_a_real_training_run(tmp_path):
    binary = require("prometheus")
    train_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: seektrain\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{train_port}']\n"
    )
    prom = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    trainer = _start_training(tmp_path / "run", train_port, steps=400)
    api = f"http://127.0.0.1:{web_port}/api/v1/query?"
    try:
        scraped, queried, deadline = None, None, time.monotonic() + 120
        while time.monotonic() < deadline and (scraped is None or queried is None):
            assert trainer.poll() is None, trainer.stdout.read()[-3000:]
            try:
                samples = _scrape(train_port)
                if samples.get("seektrain_step", 0) >= 1 and REQUIRED <= set(samples):
                    scraped = samples
                result = _get(api + urllib.parse.urlencode({"query": "seektrain_loss"}))["data"]["result"]
                if result:
                    queried = float(result[0]["value"][1])
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        assert scraped is not None, "the run's /metrics never showed every required metric"
        assert 0 < scraped["seektrain_loss"] < 10 and scraped["seektrain_tokens_per_second"] > 0
        for layer in ("1", "2", "3", "4"):  # layer 0 is dense; 4 is the MTP block's MoE
            assert 1 <= scraped[("seektrain_moe_load_max_over_mean", layer)] <= 4
            assert scraped[("seektrain_moe_router_entropy", layer)] > 0
        assert queried is not None and 0 < queried < 10, "Prometheus never returned seektrain_loss"
    finally:
        for proc in (trainer, prom):
            stop_process(proc)


def test_profile_steps_write_a_chrome_trace(tmp_path):
    run = tmp_path / "run"
    seektrain(
        "train",
        "--set",
        f"run.dir={run}",
        "--set",
        "train.steps=3",
        "--set",
        "profile.steps=2",
        *[a for item in TINY for a in ("--set", item)],
    )
    traces = list((run / "profile").glob("*.json"))
    assert traces and traces[0].stat().st_size > 1000
    assert '"traceEvents"' in traces[0].read_text()[:100000]


def test_flops_command_prints_a_breakdown():
    out = seektrain("flops", "--set", "train.seq_len=32", "--set", "model.preset=tiny-v3").stdout
    assert "layers" in out and "lm_head" in out and "mtp" in out and "counted" in out
