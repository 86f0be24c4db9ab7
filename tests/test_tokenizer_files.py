"""The tokenizer travels with the model: the run folder's copy (with the template the data was rendered
with), and the tokenizer half of a `convert --to-hf` folder that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_fixtures import BOS, EOS, TEMPLATE, build_chat_tokenizer, write_chat_jsonl
from seektrain.data.chat_template import load_chat_template
from seektrain.data.hf_tokenizer import write_hf_tokenizer
from seektrain.data.prepare import RowOptions, prepare_dataset
from seektrain.data.tokenizer_files import RUN_TOKENIZER_DIR, copy_to_run

DEEPSEEK_LLM = (
    Path(__file__).resolve().parent.parent / "seektrain/data/templates/deepseek-llm.jinja"
).read_text()


def _prepared(tmp_path: Path, template: str | None, builtin: str | None = None):
    tok = build_chat_tokenizer(tmp_path / "tok", template)
    manifest = prepare_dataset(
        [write_chat_jsonl(tmp_path / "chat.jsonl", 6)],
        tmp_path / "data",
        str(tok),
        val_fraction=0.0,
        rows=RowOptions(chat_template=builtin),
    )
    return tok, manifest


def test_the_run_folder_gets_the_tokenizer_and_its_own_template(tmp_path):
    tok, manifest = _prepared(tmp_path, TEMPLATE)
    assert "copied" in copy_to_run(manifest, tmp_path / "run")
    copy = tmp_path / "run" / RUN_TOKENIZER_DIR
    assert sorted(p.name for p in copy.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (copy / name).read_bytes() == (tok / name).read_bytes()
    copy_to_run(manifest, tmp_path / "run")  # a resumed run replaces it whole
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [RUN_TOKENIZER_DIR]


def test_a_built_in_template_the_data_was_rendered_with_goes_into_the_copy(tmp_path):
    tok, manifest = _prepared(tmp_path, template=None, builtin="deepseek-llm")
    (tok / "chat_template.jinja").write_text("{{ 'not what the data used' }}")  # would win over the config
    copy_to_run(manifest, tmp_path / "run")
    copy = tmp_path / "run" / RUN_TOKENIZER_DIR
    assert json.loads((copy / "tokenizer_config.json").read_text())["chat_template"] == DEEPSEEK_LLM
    assert load_chat_template(str(copy)).source == DEEPSEEK_LLM


def test_a_tokenizer_changed_since_the_data_was_prepared_is_not_copied(tmp_path):
    tok, manifest = _prepared(tmp_path, TEMPLATE)
    (tok / "tokenizer.json").write_text((tok / "tokenizer.json").read_text().replace("hello", "hellp"))
    assert "not the tokenizer.json the data was prepared with" in copy_to_run(manifest, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_exported_bare_tokenizer_json_loads_in_transformers_with_its_specials(tmp_path):
    from transformers import AutoTokenizer

    tok = build_chat_tokenizer(tmp_path / "tok", template=None)
    (tok / "tokenizer_config.json").unlink()  # only tokenizer.json: specials found by name
    out = tmp_path / "out"
    out.mkdir()
    assert write_hf_tokenizer(tok, out, vocab_size=320) == [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ]
    loaded = AutoTokenizer.from_pretrained(out)
    assert (loaded.bos_token, loaded.eos_token) == (BOS, EOS)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (
        generation["eos_token_id"] == loaded.eos_token_id
        and generation["bos_token_id"] == loaded.bos_token_id
    )


def test_a_tokenizer_bigger_than_the_model_is_refused(tmp_path):
    tok = build_chat_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match="has 300 tokens but the model has vocab_size 256"):
        write_hf_tokenizer(tok, tmp_path, vocab_size=256)


def test_a_re_export_replaces_the_tokenizer_files_it_wrote(tmp_path):
    from seektrain.cli.main import main

    tok = build_chat_tokenizer(tmp_path / "tok")
    out = tmp_path / "out"
    for _ in range(2):  # the second time the folder holds tokenizer files convert wrote: replaced
        assert main(["convert", "--preset", "tiny-v3", "--to-hf", str(out), "--tokenizer", str(tok)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (
        main(["convert", "--preset", "tiny-v3", "--to-hf", str(out)]) == 0
    )  # no tokenizer now: none left over
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
