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
from seektrain.errors import UserError

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
    path = Path(ckpt) / CHECKSUMS
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        return f"{path} unreadable ({str(err).splitlines()[0][:200]})"
    if not isinstance(recorded, dict) or not recorded:
        return f"{path} is not an object of file name -> sha256"
    for name, digest in recorded.items():
        if not isinstance(digest, str) or Path(name).name != name or name in (".", ".."):
            return f"{path}: entry {name!r} is not a file of this checkpoint with its sha256"
        f = Path(ckpt) / name
        if not f.is_file():
            return f"{f} is missing"
        if sha256_file(f) != digest:
            return f"{f} does not match its checksum (truncated or corrupt)"
    return None


def read_trainer_state(ckpt: Path) -> dict:
    path = Path(ckpt) / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise UserError(
            f"{path} unreadable ({str(err).splitlines()[0][:200]}); pick another checkpoint"
        ) from None
    problem = trainer_state_problem(state)
    if problem:
        raise UserError(f"{path}: {problem}; pick another checkpoint") from None
    return state


def trainer_state_problem(state) -> str | None:
    """The shape ``restore_trainer_state`` relies on: a step, and the states it holds as objects (which
    of them a full training checkpoint must hold is checked when they are restored)."""
    if not isinstance(state, dict):
        return f"expected a JSON object, got {type(state).__name__}"
    if type(state.get("step")) is not int or state["step"] < 0:
        return f"field 'step' must be an integer >= 0, got {state.get('step')!r}"
    if state.get("weights_only"):
        return None
    for key in ("scheduler", "scaler", "data"):
        if key in state and not isinstance(state[key], dict):
            return f"field {key!r} must be a JSON object, got {type(state.get(key)).__name__}"
    return None


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
            raise UserError(
                f"checkpoint {path} is unusable: {problem}; pick an earlier one under {path.parent}"
            )
        return path
    if path.name.endswith(".tmp") or (path / ".metadata").is_file():
        raise UserError(
            f"{path} is not a complete checkpoint (being written, or its save was interrupted); "
            f"pick a step-N folder under {path.parent}"
        )
    unusable: list[str] = []
    if (
        path.is_dir()
        and newest_valid(path, lambda c, p: unusable.append(f"{c.name}: {p}")) is None
        and unusable
    ):
        raise UserError(
            f"{path / CHECKPOINTS} holds no valid checkpoint ({unusable[0]}); restore that file, or "
            "train again"
        )
    if not path.is_dir():
        raise UserError(
            f"{path} not found: pass a run dir (made by `seektrain train`) or one of its "
            "checkpoints/step-N folders"
        )
    found = newest_valid(path)
    if found is None:
        raise UserError(
            f"{path / CHECKPOINTS} holds no complete, valid checkpoint; train first (seektrain train)"
        )
    return found
