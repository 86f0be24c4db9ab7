"""Sharded checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout under ``run.dir/checkpoints/``::

    step-00000100/            a complete checkpoint (DCP shards + .metadata)
        trainer_state.json    step, scheduler, loss scaler, data position, config
        checksums.json        sha256 of every file, written after all ranks finished
        COMPLETE              written last: a checkpoint without it is never loaded
    step-00000200.tmp/        being written (async or interrupted): invisible to resume

Every rank writes its own shards into the ``.tmp`` folder; after a barrier rank 0 records checksums,
writes the marker and renames the folder, so a crash at any moment leaves either the previous set of
checkpoints or the new one, never a half one that looks whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger("seektrain.checkpoint")
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
CHECKSUMS = "checksums.json"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the fix."""


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int, async_save: bool, rank: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.async_save, self.rank = keep, async_save, rank
        self._pending = None  # (future, tmp dir, final dir, trainer state) of an async save

    # ------------------------------------------------------------------ discovery
    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir()
                 if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")
                 and (p / COMPLETE).is_file()]
        return sorted(found, key=lambda p: p.name)

    def verify(self, path: Path) -> str | None:
        """None when every file matches its recorded checksum, else what is wrong."""
        try:
            recorded = json.loads((path / CHECKSUMS).read_text())
        except (OSError, ValueError) as err:
            return f"{path / CHECKSUMS} unreadable ({err})"
        for name, digest in recorded.items():
            f = path / name
            if not f.is_file():
                return f"{f} is missing"
            if _sha256(f) != digest:
                return f"{f} does not match its checksum (truncated or corrupt)"
        return None

    def latest_valid(self) -> Path | None:
        """Newest complete checkpoint whose checksums hold; corrupt ones are skipped with a warning."""
        for path in reversed(self.complete_checkpoints()):
            problem = self.verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is unusable: %s; falling back to the previous one", path.name, problem)
        return None

    # ------------------------------------------------------------------ save
    def save(self, step: int, model: nn.Module, optimizer, trainer_state: dict) -> None:
        self.wait()  # at most one save in flight
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except OSError as err:
                raise CheckpointError(f"cannot create checkpoint folder {tmp}: {err.strerror}; "
                                      "check run.dir is writable and has free space") from None
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=str(tmp))
                self._pending = (future, tmp, final, trainer_state)
                return
            dcp.save(state, checkpoint_id=str(tmp))
        except Exception as err:  # noqa: BLE001 - disk full, permissions: report, keep old checkpoints
            raise CheckpointError(f"writing checkpoint {tmp} failed: {err}; earlier checkpoints are "
                                  "untouched. Free disk space or fix run.dir permissions") from None
        self._commit(tmp, final, trainer_state)

    def wait(self) -> None:
        """Finish an async save in flight (and commit it)."""
        if self._pending is None:
            return
        future, tmp, final, trainer_state = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"async checkpoint {tmp} failed: {err}; earlier checkpoints are untouched. "
                                  "Free disk space or fix run.dir permissions") from None
        self._commit(tmp, final, trainer_state)

    def _commit(self, tmp: Path, final: Path, trainer_state: dict) -> None:
        _barrier()
        if self.rank == 0:
            try:
                (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
                sums = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
                (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1))
                (tmp / COMPLETE).write_text("ok\n")
                _fsync_dir(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(self.root)
            except OSError as err:
                raise CheckpointError(f"committing checkpoint {final} failed: {err.strerror}; earlier "
                                      "checkpoints are untouched. Free disk space") from None
            self._prune()
        _barrier()

    def _prune(self) -> None:
        for old in self.complete_checkpoints()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model: nn.Module, optimizer) -> dict:
        """Load model + optimizer shards into this rank's layout (DCP reshards as needed)."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {path} cannot be loaded into this model: {err}; "
                                  "was it written by a different model.preset?") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return json.loads((path / TRAINER_STATE).read_text())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
