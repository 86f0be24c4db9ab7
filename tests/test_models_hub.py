"""`seektrain.models.from_pretrained` / `save_pretrained` at the package level, and hub ids (org/name)
for `model.hf_path`, `convert --from-hf` and the tokenizer, resolved offline from a pre-populated cache
laid out as huggingface_hub lays it (models--org--name/snapshots/<rev>, refs/main)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import seektrain.models as models
from run_cli import seektrain, train
from seektrain.data.tokenizer import load_tokenizer
from seektrain.models.deepseek import hf_io
from seektrain.models.hub import is_hub_id, resolve_local_path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def tiny_model(seed: int = 5):
    return models.build_model(models.get_preset("tiny-dense"), seed=seed)


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))


@pytest.fixture
def hub_cache(tmp_path):
    """A hub cache holding org/tiny: a tiny model saved with save_pretrained and a tokenizer.json."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / REVISION
    models.save_pretrained(tiny_model(), snapshot)
    build_tokenizer(snapshot / "tokenizer.json")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    """In this process: point huggingface_hub at the cache (it reads HF_HUB_CACHE when imported)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def hub_env(cache: Path) -> dict:
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}


def test_package_level_save_and_from_pretrained(tmp_path):
    assert models.from_pretrained is hf_io.from_pretrained and models.save_pretrained is hf_io.save_pretrained
    model = tiny_model()
    assert models.save_pretrained(model, tmp_path / "m") == ["model.safetensors"]
    loaded = models.from_pretrained(tmp_path / "m")
    assert loaded.cfg.name == "m"
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_hub_id_form():
    assert is_hub_id("deepseek-ai/DeepSeek-V3") and is_hub_id("org/tiny.v2")
    assert not is_hub_id("byte") and not is_hub_id("/abs/org/name") and not is_hub_id("a/b/c")
    assert not is_hub_id("../x") and not is_hub_id("org/..")


def test_local_path_wins_over_the_cache(offline_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve_local_path("org/tiny", "model.hf_path") == Path("org/tiny")


def test_resolve_from_the_cache_in_process(offline_cache):
    path = resolve_local_path("org/tiny", "model.hf_path")
    assert path == offline_cache / "models--org--tiny" / "snapshots" / REVISION
    model = models.from_pretrained("org/tiny")
    assert model.cfg.name == "tiny"
    want, got = tiny_model().state_dict(), model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    tok = load_tokenizer("org/tiny")
    assert tok.spec == "org/tiny" and tok.encode("hello world") == [2, 3] and tok.eos_id == 1


def test_uncached_hub_id_is_one_line(offline_cache):
    with pytest.raises(ValueError) as err:
        resolve_local_path("org/absent", "model.hf_path")
    msg = str(err.value)
    assert "\n" not in msg and "model.hf_path='org/absent'" in msg and "hf download org/absent" in msg
    with pytest.raises(ValueError, match="hf download org/absent"):
        models.from_pretrained("org/absent")
    with pytest.raises(ValueError, match="hf download org/absent"):
        load_tokenizer("org/absent")


def test_missing_huggingface_hub_is_one_line(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ValueError) as err:
        resolve_local_path("org/tiny", "data.tokenizer")
    assert "pip install huggingface_hub" in str(err.value) and "\n" not in str(err.value)


def test_convert_and_data_prepare_read_hub_ids_offline(hub_cache, tmp_path):
    env = hub_env(hub_cache)
    seektrain("convert", "--from-hf", "org/tiny", "--to-hf", str(tmp_path / "out"), env=env)
    got = models.from_pretrained(tmp_path / "out").state_dict()
    want = tiny_model().state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)

    (tmp_path / "text.txt").write_text("hello world\n\nworld hello hello\n")
    seektrain(
        "data",
        "prepare",
        "--input",
        str(tmp_path / "text.txt"),
        "--output",
        str(tmp_path / "data"),
        "--tokenizer",
        "org/tiny",
        "--val-fraction",
        "0",
        env=env,
    )
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["tokenizer"]["spec"] == "org/tiny" and manifest["tokenizer"]["vocab_size"] == 4

    proc = seektrain(
        "convert", "--from-hf", "org/absent", "--to-hf", str(tmp_path / "o2"), env=env, check=False
    )
    assert proc.returncode == 2 and "hf download org/absent" in proc.stderr


def test_train_starts_from_a_hub_id(hub_cache, tmp_path):
    """model.hf_path=org/tiny goes through the launcher's layout check and the worker's model load."""
    run = tmp_path / "run"
    train(run, "model.hf_path=org/tiny", "train.steps=1", env=hub_env(hub_cache))
    assert json.loads((run / "model_config.json").read_text())["name"] == "tiny"
