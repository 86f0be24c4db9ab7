"""User errors of the Hugging Face loader and the ``convert`` command: one line, naming file and tensor."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seektrain.cli import convert
from seektrain.models import build_model, get_preset
from seektrain.models.deepseek.hf_io import from_pretrained, save_pretrained


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3")
    save_pretrained(build_model(get_preset("tiny-v3"), seed=0), path)
    return path


def _copy(src, dst, edit=None, config_edit=None):
    """Copy a single-file model folder, letting ``edit`` change the tensor dict / config dict."""
    dst.mkdir(exist_ok=True)
    with safe_open(src / "model.safetensors", "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    if edit:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _error(path, pattern: str) -> str:
    with pytest.raises(ValueError) as info:
        from_pretrained(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert re.search(pattern, message), message
    return message


def test_missing_folder(tmp_path):
    _error(tmp_path / "nope", r"nope: no such directory")


def test_missing_config(tmp_path):
    _error(tmp_path, r"config\.json: missing")


def test_unreadable_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    _error(tmp_path, r"config\.json: unreadable JSON")


def test_unsupported_architecture(tmp_path, v3_dir):
    def edit(c):
        c["architectures"] = ["MistralForCausalLM"]
        c["model_type"] = "mistral"

    _error(_copy(v3_dir, tmp_path / "m", config_edit=edit), r"unsupported architecture MistralForCausalLM")


def test_missing_and_inconsistent_config_fields(tmp_path, v3_dir):
    _error(
        _copy(v3_dir, tmp_path / "a", config_edit=lambda c: c.pop("hidden_size")),
        r"config\.json: missing field 'hidden_size'",
    )
    _error(
        _copy(v3_dir, tmp_path / "b", config_edit=lambda c: c.update(num_experts_per_tok=99)),
        r"config\.json: .*num_experts_per_tok must be in 1\.\.n_routed_experts",
    )
    _error(
        _copy(
            v3_dir,
            tmp_path / "c",
            config_edit=lambda c: c.update(rope_scaling={"type": "linear", "factor": 2}),
        ),
        r"rope scaling type 'linear' is not supported",
    )


def test_no_weights(tmp_path, v3_dir):
    (tmp_path / "config.json").write_text((v3_dir / "config.json").read_text())
    _error(tmp_path, r"no model\.safetensors or model\.safetensors\.index\.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    _error(tmp_path, r"only pickle \.bin weights")


def test_corrupt_safetensors(tmp_path, v3_dir):
    (tmp_path / "config.json").write_text((v3_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    _error(tmp_path, r"model\.safetensors: not a readable safetensors file")


def test_missing_shard(tmp_path):
    files = save_pretrained(
        build_model(get_preset("tiny-dense"), seed=0), tmp_path, max_shard_bytes=1_000_000
    )
    assert files[1] == f"model-00002-of-{len(files):05d}.safetensors"
    (tmp_path / files[1]).unlink()
    _error(tmp_path, rf"{files[1]}: missing shard \(listed in model\.safetensors\.index\.json\)")


def test_misshaped_tensor(tmp_path, v3_dir):
    def edit(t):
        t["model.layers.1.mlp.gate.weight"] = torch.zeros(8, 64)

    message = _error(_copy(v3_dir, tmp_path / "m", edit), r"")
    assert (
        message == "model.layers.1.mlp.gate.weight: expected shape (8, 128), got (8, 64) in model.safetensors"
    )


def test_missing_tensor(tmp_path, v3_dir):
    _error(
        _copy(v3_dir, tmp_path / "a", lambda t: t.pop("model.layers.2.self_attn.o_proj.weight")),
        r"^model\.layers\.2\.self_attn\.o_proj\.weight: missing tensor \(expected shape \(128, 128\)\)",
    )
    _error(
        _copy(v3_dir, tmp_path / "b", lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight")),
        r"^model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight: missing tensor \(expected shape \(64, 128\)\)",
    )
    # an MTP layer that is only partly there is an error, not a silently dropped module
    _error(
        _copy(v3_dir, tmp_path / "c", lambda t: t.pop("model.layers.4.enorm.weight")),
        r"^model\.layers\.4\.enorm\.weight: missing tensor",
    )


def test_unexpected_tensor(tmp_path, v3_dir):
    def edit(t):
        t["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(64, 128)

    _error(
        _copy(v3_dir, tmp_path / "m", edit),
        r"^model\.layers\.1\.mlp\.experts\.8\.up_proj\.weight: unexpected tensor in model\.safetensors",
    )


def test_fp8_without_scale(tmp_path, v3_dir):
    key = "model.layers.0.self_attn.o_proj.weight"

    def edit(t):
        t[key] = t[key].to(torch.float8_e4m3fn)

    _error(_copy(v3_dir, tmp_path / "a", edit), rf"^{re.escape(key)}_scale_inv: missing tensor")

    def edit_bad_scale(t):
        edit(t)
        t[key + "_scale_inv"] = torch.ones(2, 2)

    _error(
        _copy(v3_dir, tmp_path / "b", edit_bad_scale),
        rf"^{re.escape(key)}_scale_inv: expected shape \(1, 1\), got \(2, 2\)",
    )


# ------------------------------------------------------------------------------ the convert command
def test_cli_user_error_is_one_line(tmp_path, capsys):
    status = convert.main(["convert", "--from-hf", str(tmp_path / "missing"), "--to-hf", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert status == convert.EXIT_USER_ERROR
    assert err.startswith("seektrain convert: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert convert.main(["convert", "--to-hf", str(tmp_path / "o")]) == convert.EXIT_USER_ERROR
    assert "give exactly one source: --from-hf or --preset" in capsys.readouterr().err
    assert (
        convert.main(["convert", "--preset", "nope", "--to-hf", str(tmp_path / "o")])
        == convert.EXIT_USER_ERROR
    )
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_cli_preset_then_hf_to_hf(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert (
        convert.main(
            ["convert", "--preset", "tiny-v3", "--to-hf", str(first), "--seed", "3", "--dtype", "bf16"]
        )
        == 0
    )
    assert json.loads((first / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (
        convert.main(
            ["convert", "--from-hf", str(first), "--to-hf", str(second), "--max-shard-size", "200KB"]
        )
        == 0
    )
    assert (second / "model.safetensors.index.json").exists()
    a, b = from_pretrained(first).state_dict(), from_pretrained(second).state_dict()
    assert b["embed_tokens.weight"].dtype == torch.float32  # loaded in fp32: stored as bf16 both times
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = build_model(get_preset("tiny-v3"), dtype=torch.bfloat16, seed=3).state_dict()
    assert torch.equal(
        a["layers.1.mlp.experts.gate_up_proj"], ref["layers.1.mlp.experts.gate_up_proj"].float()
    )


def test_parse_size():
    assert convert.parse_size("5GB") == 5 * 10**9
    assert convert.parse_size("2GiB") == 2 * 1024**3
    assert convert.parse_size("123") == 123
    with pytest.raises(argparse.ArgumentTypeError):
        convert.parse_size("lots")


def test_main_cli_dispatches_convert(tmp_path):
    main = pytest.importorskip("seektrain.cli.main")
    assert main.main(["convert", "--preset", "tiny-dense", "--to-hf", str(tmp_path)]) == 0
    assert from_pretrained(tmp_path).cfg.arch == "llama"


def test_truncated_safetensors(tmp_path, v3_dir):
    """A download cut short: the header lists bytes the file does not have (checked before reading)."""
    folder = _copy(v3_dir, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    _error(
        folder,
        r"model\.safetensors: not a readable safetensors file \(tensor .* past the end of the file .*truncated",
    )


def test_weight_of_a_non_float_dtype(tmp_path, v3_dir):
    key = "model.layers.0.self_attn.o_proj.weight"

    def edit(t):
        t[key] = t[key].to(torch.int32)

    _error(
        _copy(v3_dir, tmp_path / "m", edit), rf"^{re.escape(key)}: dtype torch\.int32 in model\.safetensors"
    )


def _same_folder_worker(rank: int, out_dir: str, folders: list[str]) -> None:
    from seektrain.train.setup_model import check_same_folder

    try:
        check_same_folder(folders[rank], 2)
        message = "no error"
    except ValueError as err:
        message = str(err)
    with open(f"{out_dir}/rank{rank}.txt", "w") as fh:
        fh.write(message)


def test_ranks_that_see_different_folders_stop(tmp_path, v3_dir):
    """Node-local copies of model.hf_path that differ (another release, a fine-tune) would give the
    ranks slices of two models: the fingerprints are compared first."""
    from functools import partial

    from spawn_ranks import spawn_ranks

    other = tmp_path / "other"
    save_pretrained(build_model(get_preset("tiny-v3"), seed=1), other)
    spawn_ranks(partial(_same_folder_worker, folders=[str(v3_dir), str(other)]), 2, str(tmp_path))
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert re.match(
            r"model\.hf_path=.*: rank 1 sees a different model there than rank 0 \(fingerprint", message
        ), message
    spawn_ranks(partial(_same_folder_worker, folders=[str(v3_dir), str(v3_dir)]), 2, str(tmp_path))
    assert (tmp_path / "rank1.txt").read_text() == "no error"
