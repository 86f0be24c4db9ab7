"""`seektrain data prepare|info|verify` handlers, driven through the argparse tree `register` builds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from seektrain.cli import data_cmd


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="seektrain")
    data_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_prepare_info_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"content": f"line {i} " * 20}) + "\n" for i in range(300)))
    out = tmp_path / "out"
    argv = [
        "data",
        "prepare",
        "--input",
        str(src),
        "--output",
        str(out),
        "--text-field",
        "content",
        "--shard-tokens",
        "10000",
    ]
    assert run(argv) == 0
    printed = capsys.readouterr().out
    assert "300 documents" in printed and "val       3 documents" in printed
    assert run(["data", "info", str(out)]) == 0
    assert "tokenizer byte (vocab 259, eos 257, bos 256)" in capsys.readouterr().out
    assert run(["data", "verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    with pytest.raises(ValueError, match="already a prepared dataset; pass --force"):
        run(argv)
    assert run(argv + ["--force"]) == 0
    (out / "val-00000.bin").write_bytes(b"\0" * (out / "val-00000.bin").stat().st_size)
    with pytest.raises(ValueError, match="val-00000.bin: sha256 mismatch"):
        run(["data", "verify", str(out)])


def test_info_without_manifest(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no manifest.json found"):
        run(["data", "info", str(tmp_path)])


def test_bare_data_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["data"]) == 2
    assert "prepare" in capsys.readouterr().out
