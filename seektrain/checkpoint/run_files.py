"""The small files of a run dir that say what was trained: the config and the model.

Why one module: ``seektrain sample``, ``seektrain convert`` and resume all need "which model does this
checkpoint hold", and each had its own reader with its own error message.

Which ``model_config.json`` belongs to a checkpoint: the one of its run dir
(``RUN/checkpoints/step-N`` -> ``RUN/model_config.json``), unless the checkpoint lies in a folder set
aside by ``checkpoint.resume=never`` (``RUN/checkpoints.before-<time>/step-N``), which carries the
model config of the run it came from.

``model_source.json`` marks a run dir made by ``seektrain convert --to-checkpoint``: its model is the
converted one (often not a preset at all), so resuming it never compares it with ``model.preset``.
"""

from __future__ import annotations

import json
from pathlib import Path

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig

MODEL_CONFIG = "model_config.json"
RUN_CONFIG = "config.toml"
MODEL_SOURCE = "model_source.json"


def read_run_config(run_dir: str | Path):
    """The resolved ``JobConfig`` a run was trained with (its ``config.toml``)."""
    from seektrain.config.loader import load_config

    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise UserError(f"{path} not found: --run must name a folder made by `seektrain train`")
    return load_config(path)


def read_model_config(run_dir: str | Path) -> ModelConfig:
    """The model a run dir (or a set-aside checkpoints folder) holds, from its ``model_config.json``."""
    path = Path(run_dir) / MODEL_CONFIG
    if not path.is_file():
        raise UserError(
            f"{path} not found: a run dir with checkpoints holds the model_config.json that "
            "`seektrain train` writes"
        )
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise UserError(f"expected a JSON object, got {type(data).__name__}")
        return ModelConfig.from_dict(data)
    except (ValueError, TypeError, AttributeError, RecursionError) as err:
        raise UserError(
            f"{path} is not a valid model config ({str(err).splitlines()[0][:200]}); restore it "
            "from the run that wrote it"
        ) from None


def model_files_dir(ckpt: str | Path) -> Path:
    """The folder whose ``model_config.json`` describes checkpoint folder ``ckpt`` (see module doc)."""
    ckpt = Path(ckpt)
    return ckpt.parent if (ckpt.parent / MODEL_CONFIG).is_file() else ckpt.parent.parent


def checkpoint_model_config(ckpt: str | Path) -> ModelConfig:
    return read_model_config(model_files_dir(ckpt))


def model_is_converted(ckpt: str | Path) -> bool:
    """True when the checkpoint's run dir was made by ``seektrain convert --to-checkpoint``."""
    return (model_files_dir(ckpt) / MODEL_SOURCE).is_file()


def write_model_source(run_dir: str | Path, source: str) -> None:
    (Path(run_dir) / MODEL_SOURCE).write_text(
        json.dumps({"source": source, "written_by": "seektrain convert --to-checkpoint"}, indent=1)
    )
