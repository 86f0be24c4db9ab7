"""Context parallelism (``parallel.cp``) is the same computation as one process: the real ``seektrain
train`` under cp composed with tensor and expert parallelism on 4 ranks gives the single-process
losses, gradient norms and every parameter (fp32, gloo, tiny-v3: MLA, MoE, MTP; the comparison:
compare_runs.py), and its ``layout_ran`` shows the ring ran in every attention layer, the experts
exchanged their tokens and tensor parallelism sharded the weights. The other compositions (cp alone,
with FSDP, DDP, HSDP, PP under every schedule, checkpointing, packing) run in-process in
tests/test_packing_layouts.py; compile with cp in tests/test_compile.py."""

from __future__ import annotations

import pytest

from compare_runs import assert_same_run, run_layout


def test_cp2_x_tp2_x_ep4(tmp_path, one_process_run):
    """Through the CLI (launcher, loader, trainer, run monitor): expert parallelism takes whole cp × tp
    groups, so ep = cp × tp = 4 on 4 ranks with one data-parallel rank; every tp rank of every cp rank
    dispatches its share of its own chunks' tokens."""
    got = run_layout(
        tmp_path, "tiny-v3", 4, "parallel.cp=2", "parallel.tp=2", "parallel.ep=4", "parallel.dp_shard=1"
    )
    assert_same_run(got, one_process_run("tiny-v3"))


@pytest.mark.slow
def test_cp2(tmp_path, one_process_run):
    """cp=2 alone through the CLI (2 ranks); in CI its path runs in ``test_cp2_x_tp2_x_ep4`` (the CLI,
    the ring, the run monitor's hops) and ``test_packing_layouts``' cp2 row (the numbers)."""
    got = run_layout(tmp_path, "tiny-v3", 2, "parallel.cp=2")
    assert_same_run(got, one_process_run("tiny-v3"))


@pytest.mark.slow
@pytest.mark.parametrize("ep", [4, 8])
def test_fsdp2_x_cp2_x_tp2_x_ep(tmp_path, one_process_run, ep):
    """8 ranks, two data-parallel shards: ep=4 is one cp × tp group, its experts FSDP-sharded over the 2
    dp_shard ranks left (``dp_shard_mod_ep``); ep=8 draws from dp_shard too (``dp_shard_in_ep`` × cp ×
    tp), one expert per rank."""
    got = run_layout(
        tmp_path, "tiny-v3", 8, "parallel.cp=2", "parallel.tp=2", f"parallel.ep={ep}", "parallel.dp_shard=2"
    )
    assert_same_run(got, one_process_run("tiny-v3"))
