"""The package version: installed metadata, or the source tree's pyproject.toml when not installed
(running from a checkout with PYTHONPATH), so `seektrain --version` works either way."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def source_version() -> str | None:
    """``project.version`` of the checkout this package was imported from, or None outside one."""
    try:
        return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["version"]
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return None


def version() -> str:
    try:
        return metadata.version("seektrain")
    except metadata.PackageNotFoundError:
        return source_version() or "unknown"
