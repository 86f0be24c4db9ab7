"""``seektrain convert --from-checkpoint RUN --to-hf OUT`` (and ``--merge-lora``) without ever holding
the model: the release layout is written piece by piece (``models/deepseek/hf_export.py``), each piece
read from the checkpoint's saved chunks, or from the LoRA base folder's slices plus the adapters
(``hf_export_sources.py``). A LoRA checkpoint over a preset base (random init, rebuilt from its seed)
returns None: the caller builds that model in memory, as a preset is small by nature.
"""

from __future__ import annotations

from pathlib import Path

import torch

from seektrain.checkpoint.finder import resolve_checkpoint
from seektrain.checkpoint.hf_export_sources import checkpoint_boxes, checkpoint_shapes, merged_lora_boxes
from seektrain.checkpoint.lora_base import saved_base_folder
from seektrain.checkpoint.lora_checkpoint import base_record, lora_settings, spec_of
from seektrain.checkpoint.run_files import checkpoint_model_config
from seektrain.config.dtypes import dtype_from_name
from seektrain.errors import UserError
from seektrain.models.config import ModelConfig


def streamed_export(
    source: str | Path, base_dir: str | None, dtype: torch.dtype | None
) -> tuple[ModelConfig, object] | None:
    """(model config, ``write(out_dir, max_shard_bytes) -> weight files``) for checkpoint ``source`` (a
    checkpoint folder or a run dir); ``dtype`` None keeps fp32 master weights (a full checkpoint) or the
    dtype training held the base in (LoRA, merged). None for a LoRA checkpoint of a preset base."""
    from seektrain.models import export_release, open_hf_source
    from seektrain.models.registry import build_model

    ckpt = resolve_checkpoint(source)
    cfg = checkpoint_model_config(ckpt)
    saved = lora_settings(ckpt)
    meta = build_model(cfg, device="meta", init=False)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict(keep_vars=True).items()}
    if saved is None:
        _check_fits(ckpt, cfg, shapes)
        read = checkpoint_boxes(ckpt)
        out_dtype = dtype or torch.float32
    else:
        base = base_record(saved)
        if base.get("kind") != "hf":
            return None
        folder = saved_base_folder(ckpt, base, base_dir)
        base_dtype = dtype_from_name(str(saved.get("base_dtype", "float32")))
        hf = open_hf_source(str(folder), cfg, "--base")
        params = {name for name, _ in meta.named_parameters()}
        read = merged_lora_boxes(ckpt, hf, shapes, params, base_dtype, spec_of(saved).scaling)
        out_dtype = dtype or base_dtype

    def write(out: Path, max_shard_bytes: int) -> list[str]:
        return export_release(cfg, shapes, read, out, out_dtype, max_shard_bytes)

    return cfg, write


def _check_fits(ckpt: Path, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of the run dir's model is in the checkpoint with its shape (before a byte is written:
    an export would otherwise pair one model's config.json with another's tensors)."""
    held = checkpoint_shapes(ckpt)
    for name, shape in shapes.items():
        if held.get(name) != shape:
            got = f"holds {held[name]}" if name in held else "has no such tensor"
            raise UserError(
                f"checkpoint {ckpt} does not fit model {cfg.name} of its run dir ({name}: the checkpoint "
                f"{got}, the model needs {shape})"
            )
