"""Fixtures shared by the test files that compare parallel runs with one process, and the CI rule
that no test may skip (no_skips_in_ci.py)."""

from __future__ import annotations

import pytest

from compare_runs import Run, run_layout
from no_skips_in_ci import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)


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
