"""Fixtures shared by the test files that compare parallel runs with one process."""

from __future__ import annotations

import pytest
from run_cli import run_layout


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """``get(model, global_batch=4, *overrides)``: the metrics of the single-process run (5 steps, tiny
    settings), computed once per session for each argument tuple, since many layouts compare with it."""
    cache: dict = {}

    def get(model: str, global_batch: int = 4, *overrides: str) -> list[dict]:
        key = (model, global_batch, overrides)
        if key not in cache:
            run = tmp_path_factory.mktemp(f"one-{model}-{global_batch}")
            cache[key] = run_layout(run, model, 1, *overrides, global_batch=global_batch)
        return cache[key]

    return get
