"""MetricsSink: JSONL, TensorBoard and a Prometheus endpoint, all on 127.0.0.1."""

from __future__ import annotations

import json
import math
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seektrain.observe.names import (
    EXPORTED_METRICS,
    LAYER_KEYS,
    STANDARD_KEYS,
    layer_key,
    metric_name,
    tb_tag,
)
from seektrain.observe.sink import MetricsSink

REQUIRED = {
    "seektrain_step",
    "seektrain_loss",
    "seektrain_tokens_per_second",
    "seektrain_mfu",
    "seektrain_grad_norm",
    "seektrain_learning_rate",
    "seektrain_run_info",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, labelled: bool = False) -> dict:
    """name -> value; ``labelled``: (name, its layer label or None) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    if labelled:
        return {(s.name, s.labels.get("layer")): s.value for s in samples}
    return {s.name: s.value for s in samples}


def standard_record(i: int) -> dict[str, float]:
    """Every standard key, and every per-layer MoE key for layers 1 and 3 (layer 3: + 10)."""
    layers = {layer_key(key, layer): float(i) + layer for key in LAYER_KEYS for layer in (1, 3)}
    return {**{key: float(i) + 0.5 for key in STANDARD_KEYS if key != "step"}, **layers}


def test_names():
    assert metric_name("tokens_per_s") == "seektrain_tokens_per_second"
    assert metric_name("lr") == "seektrain_learning_rate"
    assert metric_name("train/loss-x.y") == "seektrain_train_loss_x_y"
    assert tb_tag("loss") == "train/loss" and tb_tag("optim_s") == "time/optim_s"
    assert tb_tag("mem_peak_gib") == "memory/mem_peak_gib" and tb_tag("tokens_per_s") == "perf/tokens_per_s"
    assert REQUIRED <= EXPORTED_METRICS


def test_sink_writes_jsonl_tensorboard_and_serves_metrics(tmp_path):
    port = free_port()
    sink = MetricsSink(tmp_path, rank=0, prometheus_port=port)
    try:
        sink.set_run_info(model="tiny-dense", world_size=2)
        for step in (1, 2, 3):
            sink.log(step, {**standard_record(step), "note": "text", "custom/thing": 7})
        samples, labelled = scrape(port), scrape(port, labelled=True)
    finally:
        sink.close()
        sink.close()  # idempotent
    assert EXPORTED_METRICS <= set(samples), EXPORTED_METRICS - set(samples)
    assert samples["seektrain_step"] == 3
    assert samples["seektrain_loss"] == 3.5
    assert samples["seektrain_custom_thing"] == 7
    assert "seektrain_note" not in samples
    # a per-layer key is its gauge's layer label: one metric, one sample per layer
    assert labelled[("seektrain_moe_router_entropy", "1")] == 4.0
    assert labelled[("seektrain_moe_load_max_over_mean", "3")] == 6.0
    assert not [name for name, _ in labelled if "layer" in name]

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["loss"] == 1.5 and records[0]["note"] == "text" and records[0]["time"] > 0
    assert records[0]["moe_top_expert_share/layer3"] == 4.0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "perf/mfu", "time/fwd_bwd_s"} <= tags
    assert [e.value for e in acc.Scalars("train/loss")] == [1.5, 2.5, 3.5]
    assert [e.value for e in acc.Scalars("moe_bias_spread/layer1")] == [2.0, 3.0, 4.0]
    with pytest.raises(OSError):  # the server is gone after close()
        scrape(port)


def test_run_info_labels(tmp_path):
    port = free_port()
    with MetricsSink(tmp_path / "myrun", rank=0, prometheus_port=port, tensorboard=False) as sink:
        sink.set_run_info(model="tiny-v3", world_size=8)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    info = [
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "seektrain_run_info"
    ]
    assert info[0].labels == {"run": "myrun", "rank": "0", "model": "tiny-v3", "world_size": "8"}


def test_nan_and_tensor_values(tmp_path):
    import torch

    port = free_port()
    with MetricsSink(tmp_path, rank=0, prometheus_port=port, tensorboard=False) as sink:
        sink.log(1, {"loss": float("nan"), "grad_norm": torch.tensor(2.0)})
        samples = scrape(port)
    assert math.isnan(samples["seektrain_loss"]) and samples["seektrain_grad_norm"] == 2.0
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert math.isnan(record["loss"]) and record["grad_norm"] == 2.0


def test_occupied_port_is_one_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError) as err:
            MetricsSink(tmp_path / "run", rank=0, prometheus_port=port)
    message = str(err.value)
    assert "metrics.prometheus_port" in message and "\n" not in message and "free port" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before opening files
    with pytest.raises(ValueError, match="metrics.prometheus_port"):
        MetricsSink(tmp_path, rank=0, prometheus_port=70000)


def test_port_zero_and_other_ranks(tmp_path):
    with MetricsSink(tmp_path, rank=0, prometheus_port=0, tensorboard=False) as sink:
        sink.log(1, {"loss": 1.0})
        assert sink.registry is None and sink.port == 0
    with MetricsSink(tmp_path, rank=1, prometheus_port=free_port(), tensorboard=False) as sink:
        sink.log(1, {"loss": 1.0})  # not rank 0: no files, no server
        assert sink.registry is None
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert not list(tmp_path.glob("metrics.rank*"))


def two_adjacent_free_ports() -> int:
    """A port p with p + 1 free as well (checked now; the kernel may reuse them later, rarely)."""
    for _ in range(100):
        base = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue
    raise AssertionError("no two adjacent free ports on 127.0.0.1 in 100 tries")


def test_all_ranks_serve_on_port_plus_local_rank(tmp_path):
    base = two_adjacent_free_ports()
    with MetricsSink(
        tmp_path, rank=3, local_rank=1, prometheus_port=base, all_ranks_serve=True, tensorboard=False
    ) as sink:
        sink.log(5, {"mem_allocated_gib": 1.25})
        assert sink.port == base + 1
        samples = scrape(base + 1)
    assert samples["seektrain_step"] == 5 and samples["seektrain_mem_allocated_gib"] == 1.25
