"""The trainer's side of resuming: which checkpoint to start from (``checkpoint.resume``), which model
that means, and restoring the small pieces of state that live in ``trainer_state.json``.

``checkpoint.resume``:

* ``auto``: the newest valid checkpoint of ``run.dir``, else a fresh start;
* ``never``: a fresh start; checkpoints already in ``run.dir`` are kept, moved aside to
  ``checkpoints.before-<UTC time>/`` with the files that describe them (model config, metrics);
* a step number: that step's checkpoint in ``run.dir``;
* a path: that checkpoint folder (or the newest valid checkpoint of that run dir), possibly of
  another run; its own ``model_config.json`` gives the model.

Why refuse a different model: a training checkpoint only loads into the model it was written for, and
silently ignoring the config (or the checkpoint) would train something other than what the user asked
for. A mismatch is an error that says how to start fresh. The exception is a run dir made by
``seektrain convert --to-checkpoint``: its model is the converted one (often no preset at all), so its
checkpoints define the model and ``model.preset`` is not compared (``run_files.MODEL_SOURCE``).

Why checkpoints of another lineage are set aside rather than left: pruning keeps the newest
``checkpoint.keep`` steps and ``auto`` resumes the newest, so a run restarted from step 200 in a dir
that still holds step 300 would later "resume" from the abandoned step 300.

Everything here except ``prepare_run_dir`` only reads, so it runs anywhere without a process group;
``CheckpointManager.resume_choice`` runs it on rank 0 and shares the result.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seektrain.checkpoint import write_lock
from seektrain.checkpoint.finder import (
    CHECKPOINTS,
    complete_checkpoints,
    is_checkpoint,
    newest_valid,
    read_trainer_state,
    resolve_checkpoint,
    step_dir_name,
    step_of,
    verify,
    warn_unusable,
)
from seektrain.checkpoint.run_files import (
    MODEL_CONFIG,
    MODEL_SOURCE,
    checkpoint_model_config,
    model_files_dir,
    model_is_converted,
    write_model_source,
)
from seektrain.errors import UserError
from seektrain.models.config import ModelConfig

log = logging.getLogger("seektrain.checkpoint")
SET_ASIDE_PREFIX = "checkpoints.before-"
# Files of a run dir that describe its checkpoints' training; they go with the checkpoints when those
# are set aside wholesale, so that the new run's metrics do not continue the old ones.
RUN_HISTORY = (
    MODEL_CONFIG,
    MODEL_SOURCE,
    "metrics.jsonl",
    "metrics.rank*.jsonl",
    "summary.json",
    "tensorboard",
)


@dataclass(frozen=True)
class ResumeChoice:
    checkpoint: Path | None  # load this one; None: start from the configured model (init or model.hf_path)
    model: ModelConfig  # the model to build: the checkpoint's own when resuming
    set_aside: tuple[Path, ...] = ()  # entries of run_dir/checkpoints that prepare_run_dir moves away first
    converted_from: str | None = (
        None  # the model comes from `seektrain convert --to-checkpoint` of this source
    )

    @property
    def start_fresh(self) -> bool:
        """The run dir holds checkpoints, but this run starts from scratch (they are set aside)."""
        return self.checkpoint is None and bool(self.set_aside)


def resolve_resume(
    run_dir: str | Path,
    spec: str,
    configured: ModelConfig,
    on_unusable: Callable[[Path, str], None] = warn_unusable,
) -> ResumeChoice:
    """What a run with ``run.dir=run_dir`` and ``checkpoint.resume=spec`` starts from (read-only).
    ``on_unusable`` hears of every newer checkpoint skipped by ``auto`` because its checksums fail.
    ValueError (one line, with the fix) for a step or path that is not a valid checkpoint, and for a
    training checkpoint of another model than ``configured``."""
    run_dir, spec = Path(run_dir), str(spec).strip()
    root = run_dir / CHECKPOINTS
    if spec == "never":
        held = sorted(root.iterdir()) if root.is_dir() else []
        return ResumeChoice(None, configured, tuple(held))
    if spec == "auto":
        ckpt = newest_valid(run_dir, on_unusable)
        if ckpt is None:
            return ResumeChoice(None, configured)
        return _resume_from(ckpt, run_dir, configured, explicit=False)
    if spec.isdigit():
        ckpt = root / step_dir_name(int(spec))
        available = ", ".join(str(step_of(p)) for p in complete_checkpoints(root)) or "none"
        if not is_checkpoint(ckpt):
            raise UserError(
                f"checkpoint.resume={spec}: {root} has no complete checkpoint of step {int(spec)} "
                f"(available steps: {available}); pick one of those, auto or never"
            )
        problem = verify(ckpt)
        if problem:
            raise UserError(
                f"checkpoint.resume={spec}: checkpoint {ckpt.name} is unusable ({problem}); "
                f"pick another step (available: {available})"
            )
        return _resume_from(ckpt, run_dir, configured, explicit=True)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(
            f"checkpoint.resume={spec}: no such folder; use auto, never, a step number of "
            f"{root}, or the path of a checkpoints/step-N folder"
        )
    try:
        ckpt = resolve_checkpoint(path)
    except ValueError as err:
        raise UserError(f"checkpoint.resume={spec}: {err}") from None
    return _resume_from(ckpt, run_dir, configured, explicit=True)


def _resume_from(ckpt: Path, run_dir: Path, configured: ModelConfig, explicit: bool) -> ResumeChoice:
    saved = checkpoint_model_config(ckpt)
    converted = read_trainer_state(ckpt).get("weights_only") or model_is_converted(ckpt)
    if converted:
        source = _converted_source(ckpt)
        if _differs(saved, configured):
            log.info(
                "%s holds model %r converted from %s: it defines this run's model (model.preset and "
                "model.hf_path are not used)",
                ckpt,
                saved.name,
                source,
            )
    elif _differs(saved, configured):
        fix = (
            "use a new run.dir, or checkpoint.resume=never to start fresh in this one"
            if not explicit
            else "configure the model it was trained with, or choose another checkpoint.resume"
        )
        if not _differs(_context_of(configured, saved), configured):
            # only the context differs: the positions its optimizer state and schedule were trained at
            # cannot change mid-run; the extension is a new run from its weights
            raise UserError(
                f"checkpoint {ckpt} was trained with rope_scaling={rope_text(saved)} but model.rope_scaling "
                f"asks for {rope_text(configured)}: keep the checkpoint's values to resume, or extend its "
                "context in a new run.dir from its weights (seektrain convert --from-checkpoint ... "
                "--to-hf DIR, then model.hf_path=DIR; docs/training.md)"
            )
        raise UserError(
            f"checkpoint {ckpt} holds model {_describe(saved, configured)} but the config asks for "
            f"model {_describe(configured, saved)}: {fix}"
        )
    return ResumeChoice(ckpt, saved, _other_lineage(ckpt, run_dir), source if converted else None)


def _differs(a: ModelConfig, b: ModelConfig) -> bool:
    """The name is a label: two configs that build the same model are the same model."""
    return dataclasses.replace(a, name="") != dataclasses.replace(b, name="")


def _context_of(source: ModelConfig, target: ModelConfig) -> ModelConfig:
    """``target`` with the context (YaRN and max_position_embeddings) of ``source``."""
    return dataclasses.replace(
        target, rope_scaling=source.rope_scaling, max_position_embeddings=source.max_position_embeddings
    )


def rope_text(cfg: ModelConfig) -> str:
    rs = cfg.rope_scaling
    if rs is None:
        return f"none (max_position_embeddings={cfg.max_position_embeddings})"
    fields = dataclasses.asdict(rs)
    fields.pop("type")
    return "{" + ", ".join(f"{k}={v}" for k, v in fields.items()) + "}"


def _describe(cfg: ModelConfig, other: ModelConfig) -> str:
    """``'tiny-v3'``, plus the fields that differ from ``other`` when the names alone do not tell."""
    if cfg.name != other.name:
        return repr(cfg.name)
    mine, theirs = cfg.to_dict(), other.to_dict()
    fields = [f"{k}={mine[k]}" for k in mine if mine[k] != theirs[k]][:3]
    return f"{cfg.name!r} ({', '.join(fields)})"


def _converted_source(ckpt: Path) -> str:
    marker = model_files_dir(ckpt) / MODEL_SOURCE
    if marker.is_file():
        try:
            return str(json.loads(marker.read_text()).get("source") or "unknown")
        except (OSError, ValueError):
            return "unknown"
    return str(read_trainer_state(ckpt).get("source") or "unknown")


def _other_lineage(ckpt: Path, run_dir: Path) -> tuple[Path, ...]:
    """Checkpoints of ``run_dir`` that are not in the past of ``ckpt``: the newer steps when ``ckpt`` is
    one of them, all of them when ``ckpt`` comes from elsewhere."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return ()
    if ckpt.parent.resolve() == root.resolve():
        newest = step_of(ckpt) or 0
        return tuple(p for p in complete_checkpoints(root) if (step_of(p) or 0) > newest)
    return tuple(sorted(root.iterdir()))


# ---------------------------------------------------------------------------------------- rank 0 only
def prepare_run_dir(run_dir: str | Path, choice: ResumeChoice) -> Path | None:
    """Rank 0, before the run writes anything: move ``choice.set_aside`` into a new
    ``checkpoints.before-<UTC time>/`` (nothing is deleted) and log one line; record a converted model
    in ``run_dir``. Returns the new folder, or None when nothing was moved. ValueError when a checkpoint
    there is still being written by another process."""
    run_dir = Path(run_dir)
    aside = _set_aside(run_dir, choice) if choice.set_aside else None
    if choice.converted_from and not (run_dir / MODEL_SOURCE).is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_model_source(run_dir, choice.converted_from)
    elif choice.checkpoint is None:
        (run_dir / MODEL_SOURCE).unlink(missing_ok=True)  # a fresh model: the marker describes nothing now
    return aside


def _set_aside(run_dir: Path, choice: ResumeChoice) -> Path:
    busy = [p for p in choice.set_aside if p.name.endswith(".tmp") and write_lock.in_use(p)]
    if busy:
        raise UserError(
            f"{busy[0]} is being written by another process ({write_lock.holder(busy[0])}); stop "
            "the job using this run.dir first, or use a new run.dir"
        )
    whole_run = (
        choice.checkpoint is None or choice.checkpoint.parent.resolve() != (run_dir / CHECKPOINTS).resolve()
    )
    aside = _new_aside_folder(run_dir)
    try:
        for entry in choice.set_aside:
            os.replace(entry, aside / entry.name)
        for pattern in RUN_HISTORY:
            for f in sorted(run_dir.glob(pattern)):
                if whole_run:
                    os.replace(f, aside / f.name)
                elif f.name in (MODEL_CONFIG, MODEL_SOURCE):  # the moved checkpoints keep their model
                    shutil.copy2(f, aside / f.name)
    except OSError as err:
        raise UserError(
            f"cannot move checkpoints of {run_dir} aside into {aside} ({err}); check that run.dir is writable"
        ) from None
    if choice.checkpoint is None:
        log.info(
            "checkpoint.resume=never: moved %d earlier checkpoint folder(s) of %s to %s (kept, not "
            "deleted); training starts from scratch",
            len(choice.set_aside),
            run_dir,
            aside.name,
        )
    else:
        log.warning(
            "resuming from %s: moved the %d checkpoint folder(s) of %s that are not in its past to %s "
            "(kept, not deleted)",
            choice.checkpoint,
            len(choice.set_aside),
            run_dir,
            aside.name,
        )
    return aside


def _new_aside_folder(run_dir: Path) -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    for n in range(1000):
        path = run_dir / f"{SET_ASIDE_PREFIX}{stamp}{f'-{n}' if n else ''}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"too many {SET_ASIDE_PREFIX}{stamp}* folders in {run_dir}")


# ----------------------------------------------------------------------------------- after loading
def restore_trainer_state(state: dict, scheduler, scaler, loader, loss_guard=None) -> int:
    """Apply ``trainer_state.json`` of a checkpoint; returns the step to continue after.

    A weights-only checkpoint (converted from Hugging Face) carries no training state: the scheduler,
    loss scaler and data position start fresh at step 0."""
    if state.get("weights_only"):
        return int(state.get("step", 0))
    missing = [key for key in ("scheduler", "scaler", "data") if not isinstance(state.get(key), dict)]
    if missing:
        raise UserError(
            f"trainer_state.json of the checkpoint has no {missing[0]!r} state (not a full training "
            "checkpoint); resume from another one or set checkpoint.resume=never"
        )
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    loader.load_state_dict(state["data"])
    if loss_guard is not None:
        loss_guard.load_state_dict(state.get("faults", {}))
    return int(state["step"])
