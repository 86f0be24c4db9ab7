"""In CI (``CI=true``) a test that skips fails instead, naming the skip reason: a skip there means a
check silently stopped running (a tool CI should install, a condition that no longer holds).
Expected failures (``xfail``) are left alone; tests left out by ``-m 'not slow'`` are deselected,
not skipped. Loaded by tests/conftest.py; as a plugin: ``pytest -p no_skips_in_ci``."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def _fail_skip(report, where: str) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"{where} skipped in CI ({reason}); CI must run every test: make its condition "
        "hold there (.ci/run installs what tests need) or remove the skip"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip(outcome.get_result(), collector.nodeid)  # e.g. a module-level pytest.importorskip
