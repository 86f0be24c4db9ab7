"""``convert --from-checkpoint RUN --to-hf`` written piece by piece (checkpoint/hf_export_run.py): a
2-step FSDP=2 run's export, sharded with an index as the releases are, loads bit-equal in our loader
(against the checkpoint's own tensors) and in transformers (every tensor it holds equal to the
files'), and holds exactly the tensors of the
in-memory export (the whole model loaded, then ``save_pretrained``); the merged LoRA export agrees
with the in-memory merge as well."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from lora_checkpoints import export_merged, make_lora_run
from run_cli import seektrain, train
from seektrain.checkpoint.export import load_checkpoint_model, load_run_checkpoint, read_all_tensors
from seektrain.checkpoint.finder import resolve_checkpoint
from seektrain.checkpoint.lora_checkpoint import lora_settings
from seektrain.checkpoint.run_files import checkpoint_model_config
from seektrain.cli.convert import _merged
from seektrain.models.deepseek.hf_io import from_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")


def _tensors(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(folder / name, "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _stored(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """What transformers 5 should hold under ``key``: the file's tensor, or for its fused in-memory
    experts (``...mlp.experts.gate_up_proj`` / ``down_proj``) the per-expert tensors stacked."""
    if key in tensors or not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return tensors[key]
    base, kind = key.rsplit(".", 1)
    experts = range(len({k for k in tensors if k.startswith(base + ".") and k.endswith(".down_proj.weight")}))
    if kind == "down_proj":
        return torch.stack([tensors[f"{base}.{e}.down_proj.weight"] for e in experts])
    return torch.stack(
        [
            torch.cat([tensors[f"{base}.{e}.gate_proj.weight"], tensors[f"{base}.{e}.up_proj.weight"]])
            for e in experts
        ]
    )


def _logits(model, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens).logits.float()


def test_fsdp_run_exports_streamed_bit_equal(tmp_path):
    run = tmp_path / "run"
    train(run, "model.preset=tiny-v3", "train.steps=2", "parallel.dp_shard=2", nproc=2)
    out = tmp_path / "hf"
    said = seektrain(
        "convert", "--from-checkpoint", str(run), "--to-hf", str(out), "--max-shard-size", "300KB"
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and f"{len(files)} weight files" in said.stdout, said.stdout
    ckpt = resolve_checkpoint(run)
    saved = {k[len("model.") :]: v for k, v in read_all_tensors(ckpt).items() if k.startswith("model.")}
    ours = from_pretrained(out)
    loaded = ours.state_dict()
    assert loaded.keys() <= saved.keys()
    wrong = [k for k in loaded if not torch.equal(loaded[k], saved[k])]
    assert not wrong, f"{len(wrong)} tensors differ from the checkpoint, e.g. {wrong[0]}"

    reference = tmp_path / "in-memory"
    save_pretrained(
        load_checkpoint_model(ckpt, checkpoint_model_config(ckpt)), reference, max_shard_bytes=300_000
    )
    streamed, whole = _tensors(out), _tensors(reference)
    assert streamed.keys() == whole.keys()
    assert all(torch.equal(streamed[k], whole[k]) for k in whole)

    transformers.logging.set_verbosity_error()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    held = theirs.state_dict()
    wrong = [k for k in held if not torch.equal(held[k], _stored(streamed, k))]
    assert not wrong, f"transformers holds {len(wrong)} tensors other than the files', e.g. {wrong[0]}"
    vocab = ours.cfg.vocab_size
    assert (_logits(theirs, vocab) - _logits(ours.eval(), vocab)).abs().max().item() < 1e-4


def test_merged_lora_streamed_equals_the_in_memory_merge(tmp_path, capsys):
    make_lora_run(tmp_path / "run", "tiny-v3", tmp_path / "base")
    assert export_merged(tmp_path / "run", tmp_path / "merged") == 0
    model, ckpt = load_run_checkpoint(tmp_path / "run")
    save_pretrained(_merged(model, lora_settings(ckpt)), tmp_path / "in-memory")
    streamed, whole = _tensors(tmp_path / "merged"), _tensors(tmp_path / "in-memory")
    assert streamed.keys() == whole.keys()
    wrong = [
        k for k in whole if streamed[k].dtype != whole[k].dtype or not torch.equal(streamed[k], whole[k])
    ]
    assert not wrong, f"{len(wrong)} merged tensors differ from the in-memory merge, e.g. {wrong[0]}"
