"""Training checkpoints <-> plain models, for ``seektrain convert`` (and anything else that wants the
weights of a run without starting a process group).

Why no process group: DCP can read any sharding into any other (``no_dist=True`` reads every shard in
this one process), so a checkpoint written by FSDP over N ranks becomes one full model here, which
``save_pretrained`` then writes as a Hugging Face folder. The other direction writes a *weights-only*
checkpoint at step 0 (``trainer_state.json`` has ``"weights_only": true``): a run pointed at that
run dir loads the weights into whatever layout it uses and starts its optimizer, schedule and data
from scratch.

Reading never modifies the run dir (finder.py only reads; the trainer's rank 0 alone tidies a run dir).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from seektrain.checkpoint.dcp_boxes import load_here
from seektrain.checkpoint.finder import CHECKPOINTS, complete_checkpoints, resolve_checkpoint, step_dir_name
from seektrain.checkpoint.lora_checkpoint import load_lora_model, lora_settings
from seektrain.checkpoint.manager import CheckpointError, CheckpointManager
from seektrain.checkpoint.run_files import MODEL_CONFIG, checkpoint_model_config, write_model_source
from seektrain.errors import UserError
from seektrain.models import build_model, config_of
from seektrain.models.config import ModelConfig


def load_checkpoint_model(ckpt: Path, model_cfg: ModelConfig) -> nn.Module:
    """A plain fp32 model with the weights (and MoE balancing biases) of checkpoint ``ckpt``."""
    model = build_model(model_cfg, init=False)
    state = {"model": model.state_dict()}
    load_here(state, ckpt, f"does not fit model {model_cfg.name} of its run dir", "pick another checkpoint")
    model.load_state_dict(state["model"])
    return model.eval()


def read_all_tensors(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds (model, buffers and optimizer state), by its flat DCP key, read
    whole into this process: what two checkpoints are compared by, tensor by tensor."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def load_run_checkpoint(path: str | Path, base_dir: str | None = None) -> tuple[nn.Module, Path]:
    """(model, checkpoint folder) for ``seektrain convert --from-checkpoint``: ``path`` is a checkpoint
    folder or a run dir (its newest valid checkpoint). A LoRA checkpoint comes back as its base with the
    adapters attached (``base_dir``: where its base folder is now, if it moved). Only reads."""
    ckpt = resolve_checkpoint(path)
    cfg = checkpoint_model_config(ckpt)
    saved = lora_settings(ckpt)
    if saved is not None:
        return load_lora_model(ckpt, cfg, saved, base_dir), ckpt
    return load_checkpoint_model(ckpt, cfg), ckpt


def write_initial_checkpoint(model: nn.Module, run_dir: str | Path, source: str = "") -> Path:
    """A weights-only step-0 checkpoint of ``model`` in a new run dir; a run with ``run.dir=RUN_DIR``
    then starts from these weights, whatever its ``model.preset`` says (``model_source.json`` records
    that this run dir's model is the converted one). Refuses a run dir that already holds checkpoints."""
    run_dir = Path(run_dir)
    held = complete_checkpoints(run_dir / CHECKPOINTS)
    if held:
        raise UserError(
            f"{run_dir} already holds checkpoints ({held[-1].name}); choose a new run dir for --to-checkpoint"
        )
    manager = CheckpointManager(run_dir, keep=1, async_save=False, rank=0)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float32)  # master weights are fp32 in training
    cfg = config_of(model)
    (run_dir / MODEL_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))
    write_model_source(run_dir, source)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            manager.save(
                0,
                model,
                None,
                {"step": 0, "weights_only": True, "source": source, "model_config": cfg.name},
            )
    except CheckpointError as err:
        raise UserError(str(err)) from None
    finally:
        manager.close()
    return manager.root / step_dir_name(0)
