"""Training checkpoints <-> plain models, for ``seektrain convert`` (and anything else that wants the
weights of a run without starting a process group).

Why no process group: DCP can read any sharding into any other (``no_dist=True`` reads every shard in
this one process), so a checkpoint written by FSDP over N ranks becomes one full model here, which
``save_pretrained`` then writes as a Hugging Face folder. The other direction writes a *weights-only*
checkpoint at step 0 (``trainer_state.json`` has ``"weights_only": true``): a run pointed at that
run dir loads the weights into whatever layout it uses and starts its optimizer, schedule and data
from scratch.

Reading never modifies the run dir (unlike resume, which moves corrupt checkpoints aside).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from seektrain.checkpoint.manager import COMPLETE, TRAINER_STATE, CheckpointError, CheckpointManager
from seektrain.checkpoint.resume import MODEL_CONFIG
from seektrain.models.config import ModelConfig
from seektrain.models.transformer import Transformer, build_model

log = logging.getLogger("seektrain.checkpoint")


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run dir, checkpoint folder) for ``RUN_DIR`` (its newest valid checkpoint) or
    ``RUN_DIR/checkpoints/step-N``; ValueError with the fix when there is none or it is corrupt."""
    path = Path(path)
    manager = CheckpointManager(path, keep=1, async_save=False, rank=0)
    if (path / COMPLETE).is_file() or (path / TRAINER_STATE).is_file():
        run_dir = path.parent.parent
        problem = manager.verify(path)
        if problem:
            raise ValueError(f"checkpoint {path} is unusable: {problem}; pick an earlier one under {path.parent}")
        return run_dir, path
    if not path.is_dir():
        raise ValueError(f"{path} not found: pass a run dir (made by `seektrain train`) or one of its "
                         "checkpoints/step-N folders")
    for ckpt in reversed(manager.complete_checkpoints()):
        problem = manager.verify(ckpt)
        if problem is None:
            return path, ckpt
        log.warning("checkpoint %s is unusable: %s; trying the previous one", ckpt.name, problem)
    raise ValueError(f"{path}/checkpoints holds no complete, valid checkpoint; train first (seektrain train)")


def read_model_config(run_dir: Path) -> ModelConfig:
    path = Path(run_dir) / MODEL_CONFIG
    if not path.is_file():
        raise ValueError(f"{path} not found: the run dir of a checkpoint must hold the model_config.json "
                         "that `seektrain train` writes")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def load_checkpoint_model(ckpt: Path, model_cfg: ModelConfig) -> Transformer:
    """A plain fp32 model with the weights (and MoE balancing biases) of checkpoint ``ckpt``."""
    model = build_model(model_cfg, init=False)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    except BaseException as err:  # DCP's CheckpointException is a BaseException  # noqa: BLE001
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        from seektrain.checkpoint.manager import describe_error

        raise ValueError(f"checkpoint {ckpt} does not fit model {model_cfg.name} of its run dir "
                         f"({describe_error(err)})") from None
    model.load_state_dict(state["model"])
    return model.eval()


def load_run_checkpoint(path: str | Path) -> tuple[Transformer, Path]:
    """(model, checkpoint folder) for ``seektrain convert --from-checkpoint``."""
    run_dir, ckpt = resolve_checkpoint(path)
    return load_checkpoint_model(ckpt, read_model_config(run_dir)), ckpt


def write_initial_checkpoint(model: Transformer, run_dir: str | Path, source: str = "") -> Path:
    """A weights-only step-0 checkpoint of ``model`` in a new run dir; a run with ``run.dir=RUN_DIR``
    then starts from these weights. Refuses a run dir that already holds checkpoints."""
    run_dir = Path(run_dir)
    manager = CheckpointManager(run_dir, keep=1, async_save=False, rank=0)
    if manager.complete_checkpoints():
        raise ValueError(f"{run_dir} already holds checkpoints ({manager.complete_checkpoints()[-1].name}); "
                         "choose a new run dir for --to-checkpoint")
    run_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float32)  # master weights are fp32 in training
    (run_dir / MODEL_CONFIG).write_text(json.dumps(model.cfg.to_dict(), indent=1))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            manager.save(0, model, None, {"step": 0, "weights_only": True, "source": source,
                                          "model_config": model.cfg.name})
    except CheckpointError as err:
        raise ValueError(str(err)) from None
    return manager.root / "step-00000000"
