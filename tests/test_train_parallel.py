"""Data-parallel training is the same computation as one process: DDP, FSDP (ZeRO-3), HSDP and
gradient accumulation all give the same losses, gradient norms and parameters after 5 steps on the
same global batch (fp32, gloo; the comparison: compare_runs.py)."""

from __future__ import annotations

import json

import pytest

from compare_runs import assert_same_run, run_layout
from run_cli import train


@pytest.fixture
def reference(one_process_run):
    """One process, two micro-batches of accumulation per step (shared with the model-parallel tests)."""
    return one_process_run("tiny-v3")


def test_reference_learns(reference):
    assert len(reference.losses) == 5
    assert reference.losses[-1] < reference.losses[0]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(tmp_path, reference, mode):
    overrides = [f"parallel.data_parallel={mode}"]
    if mode == "ddp":
        overrides += ["parallel.dp_shard=1", "parallel.dp_replicate=2"]
    assert_same_run(run_layout(tmp_path, "tiny-v3", 2, *overrides), reference)


def test_accumulation_matches_one_big_batch(tmp_path, reference):
    assert_same_run(
        run_layout(tmp_path, "tiny-v3", 1, "train.micro_batch_size=4"), reference
    )  # no accumulation


def test_hsdp_four_ranks_match_one_process(tmp_path, reference):
    """HSDP: 2 replicas of FSDP=2, one sequence per rank."""
    got = run_layout(
        tmp_path, "tiny-v3", 4, "parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch_size=1"
    )
    assert_same_run(got, reference)


def test_fsdp_shards_parameters(tmp_path, reference):
    """ZeRO-3: each of 2 ranks holds about half of the parameter elements."""
    train(tmp_path, "train.steps=1", nproc=2)
    two = json.loads((tmp_path / "summary.json").read_text())["param_elements_rank0"]
    one = json.loads((reference.dir / "summary.json").read_text())["param_elements_rank0"]
    assert 0.45 * one <= two <= 0.55 * one
