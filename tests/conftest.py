"""Fixtures shared by the test files that compare parallel runs with one process, and the CI rule
that no test may skip (no_skips_in_ci.py)."""

from __future__ import annotations

import pytest

from compare_runs import Run, run_layout
from no_skips_in_ci import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that leaves torch's default process group initialised fails, and the group ends there: a
    later in-process test would otherwise meet another test's world (a fake or one-rank group) instead
    of starting its own."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left torch's default process group initialised (destroy_process_group)")


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """``get(model, global_batch=4, *overrides)``: the single-process ``Run`` (5 steps, tiny settings),
    computed once per session for each argument tuple, since many layouts compare with it."""
    cache: dict = {}

    def get(model: str, global_batch: int = 4, *overrides: str) -> Run:
        key = (model, global_batch, overrides)
        if key not in cache:
            run = tmp_path_factory.mktemp(f"one-{model}-{global_batch}")
            cache[key] = run_layout(run, model, 1, *overrides, global_batch=global_batch)
        return cache[key]

    return get


# Tests whose path another CI test already covers, kept for `make test-slow` (pytest -m slow): the suite
# measured 43.7 min on this 2-core machine after issues 21, 22 and 24 added their layout tests, against a
# 30-minute budget. Each entry names what still guards its path in CI.
SLOW_IN_CI = {
    "tests/test_slurm.py::test_sigterm_saves_requeues_and_the_requeued_job_resumes",  # sbatch e2e + sigterm runs
    "tests/test_model_parallel.py::test_parameter_memory_per_rank",  # planner state-bytes rows
    "tests/test_model_parallel.py::test_tp2_x_pp2[tiny-v3]",  # tp2_x_pp2_other_models
    "tests/test_model_parallel.py::test_tp2_bf16",  # tp2 fp32 rows + bf16 unit tests
    "tests/test_model_parallel.py::test_tp2_x_ddp2",  # tp2_x_dp2 + ddp rows
    "tests/test_model_parallel.py::test_tp2_x_dp2[tiny-dense]",  # tp2_x_dp2[tiny-v3]
    "tests/test_model_parallel.py::test_tensor_parallel[tiny-v2]",  # tensor_parallel[tiny-v3]
    "tests/test_model_parallel.py::test_tensor_parallel[tiny-dense]",
    "tests/test_model_parallel.py::test_expert_parallel_with_fsdp[tiny-v2]",  # [tiny-v3]
    "tests/test_multinode.py::test_two_nodes_train_like_one_node[pp-fsdp-2x2]",  # fsdp-2x1 across namespaces
    "tests/test_multinode.py::test_two_nodes_train_like_one_node[tp-2x1]",
    "tests/test_bench_gpu_smoke.py::test_smoke_run_measures_or_explains_every_row",  # bench_gpu unit tests
    "tests/test_expert_parallel_layouts.py::test_dp2_x_tp2_x_ep4",  # dp2_x_tp2_x_ep2
    "tests/test_expert_parallel_layouts.py::test_dp4_x_ep2_fsdp_sharded_experts",  # FSDP×EP rows
    "tests/test_expert_parallel_layouts.py::test_tp2_x_ep2[tiny-v2]",  # [tiny-v3]
    "tests/test_checkpoint_lock.py::test_sample_and_a_trainer_start_keep_a_live_tmp",  # lock unit tests
    "tests/test_activation_checkpoint.py::test_selective_tensor_parallel_matches_one_process",  # selective EP
    "tests/test_eval.py::test_val_loss_every_interval_and_at_the_end",  # default run's val_loss
    "tests/test_doctor.py::test_comm_bus_bandwidth_on_four_ranks",  # two-rank comm test
    "tests/test_cpu_offload.py::test_offload_trains_like_no_offload",  # offload unit tests
    "tests/test_compile.py::test_compiled_blocks_train_like_eager",  # MoE-blocks recompile test
    "tests/test_train_parallel.py::test_fsdp_shards_parameters",  # layout_ran shard sizes in every run
    "tests/test_multinode.py::test_nodes_with_different_launch_options_end_with_one_line[nproc]",
    "tests/test_model_parallel.py::test_pipeline_schedules_other_models[tiny-dense-interleaved-1f1b]",
    # paths that other CI tests (the packing rows, the cp × tp × ep CLI runs, the soak script) already run
    "tests/test_model_parallel.py::test_tp2_x_dp2[tiny-v3]",  # packing tp2-fsdp2 row, dp2_x_tp2_x_ep2 CLI
    "tests/test_model_parallel.py::test_tensor_parallel[tiny-v3]",  # test_tensor_parallel, cp2_x_tp2_x_ep4 CLI
    "tests/test_model_parallel.py::test_pipeline_schedules_v3[interleaved-1f1b]",  # packing pp2-interleaved
    "tests/test_model_parallel.py::test_pipeline_schedules_v3[gpipe]",  # packing gpipe rows
    "tests/test_train_parallel.py::test_hsdp_four_ranks_match_one_process",  # packing hsdp, cp2-hsdp rows
    "tests/test_expert_parallel_layouts.py::test_tp2_x_ep2[tiny-v3]",  # dp2_x_tp2_x_ep2, cp2_x_tp2_x_ep4 CLI
    "tests/test_checkpoint_runs.py::test_killed_worker_is_restarted_and_async_saves_match",  # soak script test
    "tests/test_packing_runs.py::test_packed_chat_layout_equals_one_process[fsdp2]",  # packing fsdp rows
    "tests/test_activation_checkpoint.py::test_selective_one_process_matches_no_checkpointing",  # selective rows
    # the two-process hook version of the namespaces test (test_multinode_faults: unshared run.dir)
    "tests/test_storage_faults.py::test_a_rank_that_does_not_see_run_dir_stops_the_job_before_step_1",
    # layouts another CI test runs with more in it
    "tests/test_model_parallel.py::test_expert_parallel_with_fsdp[tiny-v3]",  # test_expert_parallel fsdp rows
    "tests/test_model_parallel.py::test_pipeline_1f1b[tiny-v2]",  # test_pipeline_1f1b[tiny-v3] (MLA + MoE)
    "tests/test_lora_layouts.py::test_lora_equals_one_process[fsdp2]",  # [fsdp2xep2]
    "tests/test_train_parallel.py::test_accumulation_matches_one_big_batch",  # test_oracle_loss accum rows
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_IN_CI:
            item.add_marker(pytest.mark.slow)
