"""Data-parallel training is the same computation as one process: DDP, FSDP (ZeRO-3), HSDP and
gradient accumulation all give the same losses on the same global batch (fp32, gloo)."""

from __future__ import annotations

import json

import pytest
from run_cli import losses, train

STEPS = ["train.steps=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, two micro-batches of accumulation per step."""
    run = tmp_path_factory.mktemp("single")
    train(run, *STEPS)
    return losses(run)


def test_reference_learns(reference):
    assert len(reference) == 4
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(tmp_path, reference, mode):
    overrides = [*STEPS, f"parallel.data_parallel={mode}"]
    if mode == "ddp":
        overrides += ["parallel.dp_shard=1", "parallel.dp_replicate=2"]
    train(tmp_path, *overrides, nproc=2)
    assert losses(tmp_path) == pytest.approx(reference, rel=2e-5, abs=2e-5)


def test_accumulation_matches_one_big_batch(tmp_path, reference):
    train(tmp_path, *STEPS, "train.micro_batch_size=4")  # no accumulation
    assert losses(tmp_path) == pytest.approx(reference, rel=2e-5, abs=2e-5)


def test_fsdp_shards_parameters(tmp_path, reference):
    """ZeRO-3: each of 2 ranks holds about half of the parameter elements."""
    train(tmp_path / "two", *STEPS, nproc=2)
    train(tmp_path / "one", *STEPS)
    two = json.loads((tmp_path / "two" / "summary.json").read_text())["param_elements_rank0"]
    one = json.loads((tmp_path / "one" / "summary.json").read_text())["param_elements_rank0"]
    assert 0.45 * one <= two <= 0.55 * one


@pytest.mark.slow
def test_hsdp_four_ranks_match_one_process(tmp_path, reference):
    train(tmp_path, *STEPS, "train.global_batch_size=8", "train.micro_batch_size=2",
          "parallel.dp_replicate=2", "parallel.dp_shard=2", nproc=4, timeout=600)
    single = tmp_path / "single8"
    train(single, *STEPS, "train.global_batch_size=8", "train.micro_batch_size=2")
    assert losses(tmp_path) == pytest.approx(losses(single), rel=2e-5, abs=2e-5)
