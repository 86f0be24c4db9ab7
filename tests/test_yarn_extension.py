"""YaRN context extension (issue 21 item 4): ``[model.rope_scaling]`` overrides on a preset or a Hugging
Face folder give logits equal to transformers' for the modified config, at positions past the original
context; the exported config carries them, through a training run's checkpoint too."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from run_cli import seektrain  # noqa: E402
from seektrain.config.loader import load_config  # noqa: E402
from seektrain.models import build_model  # noqa: E402
from seektrain.models.deepseek.hf_io import from_pretrained, save_pretrained  # noqa: E402
from seektrain.models.job_model import configured_model_config  # noqa: E402
from seektrain.parallel.parallelize import load_pretrained  # noqa: E402
from test_hf_parity import TOL, _randomize, _v3_config  # noqa: E402

ORIGINAL = 32  # a short "pre-training" context, so a 96-token sequence reaches 3x past it
EVERY_KEY = dict(factor=4.0, beta_fast=16.0, beta_slow=2.0, mscale=0.8, mscale_all_dim=0.6)


def _sets(**keys) -> list[str]:
    return [f"model.rope_scaling.{k}={v}" for k, v in keys.items()]


def _compare(folder, model) -> None:
    """transformers' logits for the Hugging Face ``folder`` equal ``model``'s over a sequence 3x the
    original context."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 3 * ORIGINAL), generator=gen)
    with torch.no_grad():
        diff = (hf_model.eval()(tokens).logits - model.eval()(tokens).logits).abs().max().item()
    assert diff <= TOL, diff


def _export_and_compare(model, tmp_path) -> dict:
    """Export ``model`` (what `convert --to-hf` writes) and compare; returns the exported rope_scaling."""
    save_pretrained(model, tmp_path / "export")
    _compare(tmp_path / "export", model)
    return json.loads((tmp_path / "export" / "config.json").read_text())["rope_scaling"]


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2"])
def test_overrides_on_a_preset_match_transformers(preset, tmp_path):
    # tiny presets have no YaRN: every key is given (mscale_all_dim on the softmax scale included)
    sets = _sets(original_max_position_embeddings=ORIGINAL, **EVERY_KEY)
    job = load_config(overrides=[f"model.preset={preset}", *sets])
    cfg = configured_model_config(job)
    assert cfg.max_position_embeddings == 4 * ORIGINAL  # factor x original
    model = build_model(cfg, seed=1)
    _randomize(model, seed=1)
    exported = _export_and_compare(model, tmp_path)
    assert exported == {"type": "yarn", "original_max_position_embeddings": ORIGINAL, **EVERY_KEY}


def test_overrides_merge_with_a_hugging_face_folders_own_yarn(tmp_path):
    """The folder extends 32 -> 64 (factor 2, mscales 0.707); the job asks for factor 8 only: the folder's
    original length, betas and mscales stay."""
    hf_cfg = _v3_config(
        max_position_embeddings=2 * ORIGINAL,
        rope_scaling=dict(
            type="yarn",
            factor=2.0,
            original_max_position_embeddings=ORIGINAL,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    )
    source = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    _randomize(source, seed=2)
    source.save_pretrained(tmp_path / "hf")
    job = load_config(overrides=[f"model.hf_path={tmp_path / 'hf'}", *_sets(factor=8)])
    cfg = configured_model_config(job)
    model = build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    load_pretrained(model, job.model.hf_path, 0)  # what the trainer starts from
    exported = _export_and_compare(model, tmp_path)
    assert cfg.max_position_embeddings == 8 * ORIGINAL
    assert exported == dict(
        type="yarn",
        factor=8.0,
        original_max_position_embeddings=ORIGINAL,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.707,
        mscale_all_dim=0.707,
    )


def test_a_trained_checkpoint_keeps_the_overrides_into_its_export(tmp_path):
    """`seektrain train` with overrides -> its checkpoint's model -> `convert --from-checkpoint --to-hf`:
    the exported folder loads in transformers with equal logits and carries every override."""
    run = tmp_path / "run"
    sets = ["model.preset=tiny-v3", f"run.dir={run}", "train.steps=1", "train.seq_len=64"]
    sets += ["train.global_batch_size=2", "train.micro_batch_size=2", "precision.dtype=fp32"]
    sets += ["train.eval_interval=0", "run.progress_bar=false", "metrics.tensorboard=false"]
    sets += _sets(original_max_position_embeddings=ORIGINAL, **EVERY_KEY)
    seektrain("train", *[a for s in sets for a in ("--set", s)], timeout=600)
    saved = json.loads((run / "model_config.json").read_text())["rope_scaling"]
    assert saved == {"type": "yarn", "original_max_position_embeddings": ORIGINAL, **EVERY_KEY}
    seektrain("convert", "--from-checkpoint", str(run), "--to-hf", str(tmp_path / "hf"))
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["rope_scaling"] == saved and exported["max_position_embeddings"] == 4 * ORIGINAL
    _compare(tmp_path / "hf", from_pretrained(tmp_path / "hf"))


def test_a_converted_run_dir_takes_the_overrides_on_its_weights(tmp_path):
    """`convert --to-checkpoint` makes a run dir whose weights-only checkpoint defines the model: the
    overrides still apply on top of it, not silently dropped."""
    from seektrain.checkpoint.export import write_initial_checkpoint
    from seektrain.models import get_preset
    from seektrain.train.startup import resolve_start

    write_initial_checkpoint(build_model(get_preset("tiny-v3"), seed=0), tmp_path / "run", source="test")
    sets = _sets(factor=4, original_max_position_embeddings=ORIGINAL)
    job = load_config(overrides=[f"run.dir={tmp_path / 'run'}", *sets])
    model = resolve_start(job, 1, "cpu").resume.model
    assert model.rope_scaling.factor == 4.0 and model.max_position_embeddings == 4 * ORIGINAL
