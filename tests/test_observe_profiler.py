"""StepProfiler writes Chrome traces of exactly the steps asked for."""

from __future__ import annotations

import json

import torch

from seektrain.models import build_model, get_preset
from seektrain.observe.profiler import StepProfiler


def test_profiler_writes_traces_of_chosen_steps(tmp_path):
    cfg = get_preset("tiny-dense")
    model = build_model(cfg, seed=0)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    profiler = StepProfiler(tmp_path, steps=[2])
    for step in range(1, 4):
        profiler.before_step(step)
        model(tokens).logits.float().mean().backward()
        optim.step()
        optim.zero_grad()
        profiler.after_step(step)
    trace = tmp_path / "profile" / "trace-step2.json"
    assert profiler.traces == [trace]
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["trace-step2.json"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in str(e.get("name", "")) for e in events)


def test_profiler_without_steps_does_nothing(tmp_path):
    profiler = StepProfiler(tmp_path, steps=range(0))
    profiler.before_step(1)
    profiler.after_step(1)
    assert not (tmp_path / "profile").exists() and profiler.traces == []


def test_profiler_before_and_after_step(tmp_path):
    profiler = StepProfiler(tmp_path, steps=[1, 3])
    for step in range(1, 4):
        profiler.before_step(step)
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.after_step(step)
    assert [p.name for p in profiler.traces] == ["trace-step1.json", "trace-step3.json"]
    assert all(p.stat().st_size > 0 for p in profiler.traces)
