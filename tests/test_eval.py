"""Validation loss: ``train.eval_interval`` evaluates the prepared ``val`` split on schedule and at the
end, logs ``val_loss`` with the step's metrics, and a tensor-parallel run (same data on both ranks)
computes the one-process value."""

from __future__ import annotations

import math

import pytest

from run_cli import metrics, train
from seektrain.observe.names import EXPORTED_METRICS, metric_name, tb_tag


def test_val_loss_every_interval_and_at_the_end(tmp_path):
    train(tmp_path / "one", "train.steps=5", "train.eval_interval=2", "train.eval_steps=2")
    records = metrics(tmp_path / "one")
    evaluated = [m["step"] for m in records if "val_loss" in m]
    assert evaluated == [2, 4, 5]
    values = [m["val_loss"] for m in records if "val_loss" in m]
    assert all(math.isfinite(v) and 0 < v < 10 for v in values)
    assert values[-1] < values[0]  # the model learns, and the same val batches show it

    train(
        tmp_path / "tp",
        "train.steps=5",
        "train.eval_interval=2",
        "train.eval_steps=2",
        "parallel.tp=2",
        "parallel.dp_shard=1",
        nproc=2,
    )
    tp_values = [m["val_loss"] for m in metrics(tmp_path / "tp") if "val_loss" in m]
    assert tp_values == pytest.approx(values, rel=1e-4)


def test_eval_off(tmp_path):
    train(tmp_path / "r", "train.steps=2", "train.eval_interval=0")
    assert all("val_loss" not in m for m in metrics(tmp_path / "r"))


def test_val_loss_is_an_exported_metric():
    assert metric_name("val_loss") in EXPORTED_METRICS
    assert tb_tag("val_loss") == "train/val_loss"


def test_every_evaluation_reads_the_same_batches(tmp_path):
    """Each evaluation reads the split from its start: two in a row get the same micro-batches (a loader
    that went on where the last one stopped would measure other windows at every ``val_loss``, and a
    resumed run's would differ from an uninterrupted run's)."""
    from types import SimpleNamespace

    import torch

    from seektrain.config.loader import load_config
    from seektrain.data import ensure_builtin_corpus
    from seektrain.train.evaluate import Evaluator

    job = load_config(None, ["train.eval_interval=1", "train.eval_steps=3", "train.seq_len=64"])
    plan = SimpleNamespace(job=job, pp=1, dp=1, cp=1, accum_steps=1)
    meshes = SimpleNamespace(dp_rank=0)  # one rank: the first data-parallel rank, no cp chunks
    evaluator = Evaluator(
        plan, meshes, ensure_builtin_corpus(tmp_path, max_tokens=2_000_000), torch.device("cpu")
    )
    first, second = evaluator.batches(), evaluator.batches()
    assert len(first) == 3
    assert all(
        torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels) for a, b in zip(first, second)
    )
    assert not torch.equal(first[0].tokens, first[1].tokens)  # three different windows, not one thrice
