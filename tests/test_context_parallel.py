"""Context parallelism (``parallel.cp``) is the same computation as one process: the real ``seektrain
train`` under cp=2 alone and composed with FSDP, MTP, packing, EP, TP and PP gives the single-process
losses, gradient norms and every parameter (fp32, gloo, tiny-v3: MLA, MoE, MTP; the comparison:
compare_runs.py), and its ``layout_ran`` shows the ring ran in every attention layer."""

from __future__ import annotations

from compare_runs import assert_same_run, run_layout


def test_cp2(tmp_path, one_process_run):
    got = run_layout(tmp_path, "tiny-v3", 2, "parallel.cp=2")
    assert_same_run(got, one_process_run("tiny-v3"))
