"""With CI=true a skipped test fails, naming its reason (no_skips_in_ci.py); outside CI it skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = """
import pytest

def test_skips_in_body():
    pytest.skip("needs a unicorn")

@pytest.mark.skipif(True, reason="never on this platform")
def test_skipped_by_marker():
    pass

@pytest.mark.xfail(strict=True, reason="a known bug")
def test_expected_failure():
    assert False

def test_passes():
    pass
"""
MISSING_IMPORT = (
    'import pytest\npytest.importorskip("no_such_module_here")\n\ndef test_never_runs():\n    pass\n'
)


def _pytest(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_missing.py").write_text(MISSING_IMPORT)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-p",
            "no_skips_in_ci",
            "--continue-on-collection-errors",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_skips_fail_in_ci(tmp_path, ci):
    proc = _pytest(tmp_path, ci)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # a skip while collecting or in set-up (skipif) becomes an error, one in the test body a failure
    assert "1 failed, 1 passed, 1 xfailed, 2 errors" in out, out
    assert "test_skips_in_body skipped in CI (Skipped: needs a unicorn)" in out
    assert "test_skipped_by_marker skipped in CI (Skipped: never on this platform)" in out
    assert "test_missing.py skipped in CI (Skipped: could not import 'no_such_module_here'" in out


def test_skips_stay_skips_outside_ci(tmp_path):
    proc = _pytest(tmp_path, None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 3 skipped, 1 xfailed" in out, out
