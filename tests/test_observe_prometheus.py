"""The deploy/prometheus files against the real tools: promtool checks, rule unit tests, and a live
Prometheus server scraping a MetricsSink fed by a small fake training loop.

The binaries come from Debian's ``prometheus`` package (.ci/run installs it). Outside CI a missing
binary skips these tests; in CI (CI=true) the skip is a failure (tests/conftest.py), so the checks
cannot silently disappear.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from run_cli import stop_process
from seektrain.observe.sink import MetricsSink

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:  # in CI (CI=true) tests/conftest.py turns this skip into a failure
        pytest.skip(f"{binary} not installed (apt-get install prometheus; .ci/run installs it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess:
    return subprocess.run([require("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_check_config():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules():
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 rules found" in result.stdout


def test_promtool_rule_unit_tests():
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read().decode())


def test_real_prometheus_scrapes_a_training_sink(tmp_path):
    binary = require("prometheus")
    sink_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {DEPLOY / 'alerts.yml'}\n"
        "scrape_configs:\n  - job_name: seektrain\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{sink_port}']\n"
    )
    sink = MetricsSink(tmp_path / "run", rank=0, prometheus_port=sink_port, tensorboard=False)
    sink.set_run_info(model="tiny-dense", world_size=1)
    stop = threading.Event()

    def fake_training() -> None:  # bounded: at most 60 s even if the test body hangs
        step, deadline = 0, time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            step += 1
            sink.log(
                step,
                {
                    "loss": 4.0 / step,
                    "lr": 1e-3,
                    "tokens_per_s": 1000.0 + step,
                    "mfu": 0.3,
                    "grad_norm": 1.0,
                    "fwd_bwd_s": 0.05,
                    "data_wait_s": 0.001,
                },
            )
            stop.wait(0.1)

    feeder = threading.Thread(target=fake_training, daemon=True)
    feeder.start()
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{web_port}/api/v1"
    try:
        step_value, rules_ok, deadline = None, False, time.monotonic() + 30
        while time.monotonic() < deadline and (step_value is None or not rules_ok):
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                query = _get(f"{api}/query?" + urllib.parse.urlencode({"query": "seektrain_step"}))
                if query["data"]["result"]:
                    step_value = float(query["data"]["result"][0]["value"][1])
                groups = _get(f"{api}/rules")["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                rules_ok = len(rules) == 5 and all(r["health"] == "ok" for r in rules)
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        assert step_value is not None and step_value > 0, (tmp_path / "prometheus.log").read_text()[-3000:]
        assert rules_ok, rules
        info = _get(f"{api}/query?" + urllib.parse.urlencode({"query": "seektrain_run_info"}))
        assert info["data"]["result"][0]["metric"]["model"] == "tiny-dense"
        tps = _get(f"{api}/query?" + urllib.parse.urlencode({"query": "seektrain_tokens_per_second"}))
        assert float(tps["data"]["result"][0]["value"][1]) > 1000
    finally:
        stop_process(proc, timeout=10)
        log.close()
        stop.set()
        feeder.join(timeout=5)
        sink.close()
