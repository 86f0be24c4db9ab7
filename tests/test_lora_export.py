"""LoRA exports (issue 24): ``convert --to-peft`` loads in peft onto transformers' model, and
``convert --merge-lora --to-hf`` loads in transformers, both with the logits of our unmerged model
(base + adapters as training ran them), for V3 (MLA, routed and shared experts), V2 and a dense model;
and the base of a LoRA checkpoint is found, checked and refused as the docs say.

The checkpoints are made in this process with large random adapters (tests/lora_checkpoints.py), so a
wrong layout of any adapter (a B row order, a nesting, a missing scaling) moves the logits far beyond
the tolerance; test_lora_checkpoint.py exports a trained run through the same commands."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lora_checkpoints import export_merged, make_lora_run
from seektrain.checkpoint.export import load_run_checkpoint
from seektrain.cli.convert import main as convert

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-4  # fp32 logits of ~4 in size, as tests/test_hf_parity.py


def logits(model, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens).logits.float()


def hf_model(folder):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2", "tiny-dense"])
def test_peft_and_merged_exports_have_our_logits(preset, tmp_path, capsys):
    ours = make_lora_run(tmp_path / "run", preset, tmp_path / "base")
    vocab = ours.cfg.vocab_size
    want = logits(ours, vocab)
    assert (
        convert(["convert", "--from-checkpoint", str(tmp_path / "run"), "--to-peft", str(tmp_path / "peft")])
        == 0
    )
    said = capsys.readouterr().out
    assert "lora_dropout written as 0" in said and ("MTP adapters left out" in said) == (preset == "tiny-v3")
    assert export_merged(tmp_path / "run", tmp_path / "merged") == 0
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    loaded, _ = load_run_checkpoint(
        tmp_path / "run"
    )  # what convert read: the checkpoint's adapters on the base
    assert (logits(loaded, vocab) - want).abs().max().item() == 0
    base = hf_model(tmp_path / "base")
    assert (logits(base, vocab) - want).abs().max().item() > 100 * TOL  # the adapters matter
    assert (logits(hf_model(tmp_path / "merged"), vocab) - want).abs().max().item() < TOL
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    assert (logits(adapted, vocab) - want).abs().max().item() < TOL
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert config["r"] == 4 and config["lora_alpha"] == 8  # scaling 2: a lost scaling shows


def test_a_preset_base_and_a_moved_base(tmp_path, capsys):
    """A preset base is rebuilt from its seed (and the --to-peft line says how to write it); a Hugging Face
    base that moved is named in one line, found with --base, and another model there is refused."""
    ours = make_lora_run(tmp_path / "preset-run", "tiny-v3", None)
    assert (
        convert(
            ["convert", "--from-checkpoint", str(tmp_path / "preset-run"), "--to-peft", str(tmp_path / "p")]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "seektrain convert --preset tiny-v3 --seed 7 --to-hf DIR" in said
    assert (
        convert(["convert", "--preset", "tiny-v3", "--seed", "7", "--to-hf", str(tmp_path / "seeded")]) == 0
    )
    adapted = peft.PeftModel.from_pretrained(hf_model(tmp_path / "seeded"), tmp_path / "p").eval()
    assert (logits(adapted, 320) - logits(ours, 320)).abs().max().item() < TOL

    make_lora_run(tmp_path / "run", "tiny-dense", tmp_path / "base")
    shutil.move(tmp_path / "base", tmp_path / "moved")
    capsys.readouterr()  # transformers' progress bars
    merge = [
        "convert",
        "--from-checkpoint",
        str(tmp_path / "run"),
        "--merge-lora",
        "--to-hf",
        str(tmp_path / "m"),
    ]
    assert convert(merge) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "base") in err[0] and "pass --base HF_DIR" in err[0]
    assert convert([*merge, "--base", str(tmp_path / "moved")]) == 0
    capsys.readouterr()
    assert (
        convert(["convert", "--preset", "tiny-dense", "--seed", "3", "--to-hf", str(tmp_path / "other")]) == 0
    )
    assert convert([*merge, "--force", "--base", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "trained on the Hugging Face folder" in err[0] and str(tmp_path / "other") in err[0]
    )
