"""LoRA checkpoints made in this process, without training: a base with weights far from uniform (as a
Hugging Face folder, or a preset's seeded init) and adapters with large random values, written as
the trainer writes them (``CheckpointManager(adapters_only=True)`` and ``lora_record``). Shared by the
export tests and the bad-input rows."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from seektrain.checkpoint.lora_checkpoint import LORA, lora_record
from seektrain.checkpoint.manager import CheckpointManager
from seektrain.checkpoint.run_files import MODEL_CONFIG
from seektrain.config.loader import load_config
from seektrain.models import build_model, get_preset
from seektrain.models.deepseek.hf_io import save_pretrained
from seektrain.models.lora import add_adapters, is_adapter
from seektrain.plan.run_plan import lora_spec
from test_hf_parity import _randomize

SEED = 7


def randomize(model: torch.nn.Module, seed: int, adapters: bool) -> None:
    """Base weights (or, with ``adapters``, the adapters) large enough that routing and attention are far
    from uniform and every adapter moves the logits (ties and tiny deltas would hide a wrong layout); an
    adapter A [.., r, in] gets ~1/sqrt(in), B [.., out, r] ~1/sqrt(r), as every other matrix."""
    _randomize(model, seed, include=lambda name: is_adapter(name) == adapters)


def make_lora_run(
    run_dir: Path,
    preset: str,
    base_dir: Path | None,
    overrides: tuple[str, ...] = ("lora.rank=4", "lora.alpha=8", "lora.dropout=0.1"),
    step: int = 1,
) -> torch.nn.Module:
    """A run dir with one LoRA checkpoint of ``preset``: its base is a new Hugging Face folder
    ``base_dir`` (random weights), or with ``base_dir=None`` the preset initialised with ``SEED``.
    Returns the model (base + adapters) the checkpoint holds."""
    cfg = get_preset(preset)
    model = build_model(cfg, seed=SEED)
    keys = [f"model.preset={preset}", f"train.seed={SEED}", "lora.enabled=true", *overrides]
    if base_dir is not None:
        randomize(model, SEED, adapters=False)
        save_pretrained(model, base_dir)
        keys.append(f"model.hf_path={base_dir}")
    job = load_config(None, keys)
    add_adapters(model, lora_spec(job))
    randomize(model, SEED + 1, adapters=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MODEL_CONFIG).write_text(json.dumps(cfg.to_dict()))
    manager = CheckpointManager(run_dir, keep=2, async_save=False, rank=0, adapters_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        manager.save(step, model, None, {"step": step, LORA: lora_record(job, cfg, torch.float32)})
    manager.close()
    return model.eval()


def export_merged(run: Path, out: Path) -> int:
    """``seektrain convert --from-checkpoint RUN --merge-lora --to-hf OUT`` in this process: its status."""
    from seektrain.cli.convert import main as convert

    return convert(["convert", "--from-checkpoint", str(run), "--merge-lora", "--to-hf", str(out)])
