"""Finding checkpoints: which ``step-N`` folders are complete, whether their files are intact, and
which one is the newest usable one. Read-only.

Why read-only: ``seektrain sample`` and ``seektrain convert`` may run while a training job writes into
the same run dir, so looking must never change anything there. Housekeeping (removing a crashed
save's ``.tmp``, moving a corrupt checkpoint aside) belongs to the trainer's rank 0 alone
(``CheckpointManager``), which uses this module to decide and passes ``on_unusable`` to act.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

from seektrain.checkpoint.storage import sha256_file

log = logging.getLogger("seektrain.checkpoint")
CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
CHECKSUMS = "checksums.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a ``step-NNNNNNNN`` folder name, else None."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_checkpoint(path: Path) -> bool:
    """A committed checkpoint folder (its ``COMPLETE`` marker is written last)."""
    return (Path(path) / COMPLETE).is_file()


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete ``step-N`` folders directly in ``folder`` (a run's ``checkpoints/``), oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and step_of(p) is not None and is_checkpoint(p)]
    return sorted(found, key=lambda p: p.name)


def tmp_folders(folder: Path) -> list[Path]:
    """``step-N.tmp`` folders in ``folder``: saves in progress or interrupted ones."""
    return sorted(Path(folder).glob("step-*.tmp")) if Path(folder).is_dir() else []


def verify(ckpt: Path) -> str | None:
    """None when every file matches its recorded checksum, else what is wrong (one line)."""
    try:
        recorded = json.loads((Path(ckpt) / CHECKSUMS).read_text())
    except (OSError, ValueError) as err:
        return f"{Path(ckpt) / CHECKSUMS} unreadable ({err})"
    for name, digest in recorded.items():
        f = Path(ckpt) / name
        if not f.is_file():
            return f"{f} is missing"
        if sha256_file(f) != digest:
            return f"{f} does not match its checksum (truncated or corrupt)"
    return None


def read_trainer_state(ckpt: Path) -> dict:
    path = Path(ckpt) / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} unreadable ({err}); pick another checkpoint") from None


def warn_unusable(ckpt: Path, problem: str) -> None:
    log.warning("checkpoint %s is unusable: %s; trying the previous one", ckpt.name, problem)


def newest_valid(run_dir: Path, on_unusable: Callable[[Path, str], None] = warn_unusable) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` whose checksums hold (None when there is none).
    Every newer one that fails is reported to ``on_unusable(path, problem)``, newest first."""
    for ckpt in reversed(complete_checkpoints(Path(run_dir) / CHECKPOINTS)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        on_unusable(ckpt, problem)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder meant by ``path``: a checkpoint folder itself (it must verify), or a run dir
    (its newest valid checkpoint). ValueError with the fix otherwise."""
    path = Path(path)
    if is_checkpoint(path):
        problem = verify(path)
        if problem:
            raise ValueError(f"checkpoint {path} is unusable: {problem}; pick an earlier one under {path.parent}")
        return path
    if path.name.endswith(".tmp") or (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (being written, or its save was interrupted); "
                         f"pick a step-N folder under {path.parent}")
    if not path.is_dir():
        raise ValueError(f"{path} not found: pass a run dir (made by `seektrain train`) or one of its "
                         "checkpoints/step-N folders")
    found = newest_valid(path)
    if found is None:
        raise ValueError(f"{path / CHECKPOINTS} holds no complete, valid checkpoint; train first (seektrain train)")
    return found
