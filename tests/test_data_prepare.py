"""`prepare_dataset`: formats, manifest, checksums, atomic output and one-line errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from seektrain.data import TokenDataset, load_tokenizer, prepare_dataset, read_manifest, verify_dataset
from seektrain.data.prepare import is_val_document

DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(50)]


def build_tiny_tokenizer(path: Path) -> Path:
    """A tiny BPE trained on the spot (same recipe as test_data_tokenizer; test files stay independent)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return path


def stream(directory: Path, split: str = "train") -> np.ndarray:
    ds = TokenDataset(directory, split)
    return np.asarray(ds.read(0, len(ds)), dtype=np.int64)


def expected_stream(docs: list[str], spec: str, val_fraction: float, split: str = "train") -> list[int]:
    tok = load_tokenizer(spec)
    out: list[int] = []
    for i, d in enumerate(docs):
        if is_val_document(i, val_fraction) == (split == "val"):
            out += tok.encode(d) + [tok.eos_id]
    return out


def test_text_directory_byte(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text(DOCS[1])
    (src / "sub" / "a.md").write_text(DOCS[0])
    (src / "empty.txt").write_text("")
    (src / "image.png").write_bytes(b"\x89PNG")  # unknown extension inside a directory: skipped
    (src / ".hidden.txt").write_text("secret")
    m = prepare_dataset([src], tmp_path / "out", "byte", val_fraction=0.0)
    # sorted walk: files of src first (b.txt, empty.txt), then sub/a.md; empty documents are dropped
    assert stream(tmp_path / "out").tolist() == expected_stream([DOCS[1], DOCS[0]], "byte", 0.0)
    assert m.documents == 2 and m.dtype == "uint16" and m.tokenizer.vocab_size == 259
    assert [Path(s["path"]).name for s in m.sources] == ["b.txt", "empty.txt", "a.md"]
    with pytest.raises(
        ValueError, match="split 'val' is empty; re-prepare with more documents or a larger --val-fraction"
    ):
        TokenDataset(tmp_path / "out", "val")


def test_jsonl_manifest_checksums_and_val_split(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n")
    out = tmp_path / "out"
    m = prepare_dataset([src], out, "byte", shard_tokens=100, val_fraction=0.1)
    assert (m.train.documents, m.val.documents) == (45, 5)
    assert stream(out).tolist() == expected_stream(DOCS, "byte", 0.1)
    assert stream(out, "val").tolist() == expected_stream(DOCS, "byte", 0.1, "val")
    on_disk = read_manifest(out)
    assert on_disk == m
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["total_tokens"] == m.train.tokens + m.val.tokens and raw["documents"] == 50
    assert len(m.train.shards) == -(-m.train.tokens // 100) and m.val.shards[0].file == "val-00000.bin"
    for shard in m.train.shards + m.val.shards:
        data = (out / shard.file).read_bytes()
        assert len(data) == 2 * shard.tokens and hashlib.sha256(data).hexdigest() == shard.sha256
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith((".bin", ".bin.crc"))) == [
        "manifest.json"
    ]
    verify_dataset(out)


def test_parquet_with_hf_tokenizer(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    tok_path = build_tiny_tokenizer(tmp_path / "tokenizer.json")
    pq.write_table(pa.table({"body": DOCS[:10], "n": list(range(10))}), tmp_path / "d.parquet")
    m = prepare_dataset(
        [tmp_path / "d.parquet"], tmp_path / "out", str(tok_path), text_field="body", val_fraction=0.0
    )
    assert m.tokenizer.spec == str(tok_path.resolve()) and m.tokenizer.eos_id == 2
    assert stream(tmp_path / "out").tolist() == expected_stream(DOCS[:10], str(tok_path), 0.0)
    with pytest.raises(ValueError, match=r"row 1: the row fits none of the formats tried: .*text \('text'\)"):
        prepare_dataset([tmp_path / "d.parquet"], tmp_path / "out2", "byte")


def test_uint32_for_large_vocab(tmp_path: Path) -> None:
    from seektrain.data.prepare import dtype_for

    assert dtype_for(259) == np.uint16 and dtype_for(65536) == np.uint16 and dtype_for(102400) == np.uint32


def test_corrupt_shard_detected(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 100)
    out = tmp_path / "out"
    prepare_dataset([tmp_path / "a.txt"], out, "byte", val_fraction=0.0)
    shard = out / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    TokenDataset(out)  # same size: only the full check notices
    with pytest.raises(ValueError, match="shard-00000.bin: sha256 mismatch"):
        TokenDataset(out).verify()
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="truncated or modified"):
        TokenDataset(out)


def test_existing_output_needs_force(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first")
    out = tmp_path / "out"
    prepare_dataset([tmp_path / "a.txt"], out, "byte")
    (tmp_path / "a.txt").write_text("second version")
    with pytest.raises(ValueError, match="already a prepared dataset; pass --force"):
        prepare_dataset([tmp_path / "a.txt"], out, "byte")
    assert read_manifest(out).train.tokens == len("first") + 1
    prepare_dataset([tmp_path / "a.txt"], out, "byte", force=True)
    assert read_manifest(out).train.tokens == len("second version") + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]  # no temp dirs left behind
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not empty"):
        prepare_dataset([tmp_path / "a.txt"], tmp_path / "full", "byte")


def test_failure_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "ok.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"ok.jsonl:2: no field 'text' .*--text-field"):
        prepare_dataset([tmp_path / "ok.jsonl"], tmp_path / "out", "byte")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.jsonl"]


def test_max_tokens_stops_at_document_boundary(tmp_path: Path) -> None:
    for i, d in enumerate(DOCS[:20]):
        (tmp_path / f"{i:02d}.txt").write_text(d)
    m = prepare_dataset([tmp_path], tmp_path / "out", "byte", val_fraction=0.0, max_tokens=100)
    assert stream(tmp_path / "out").tolist() == expected_stream(DOCS[: m.documents], "byte", 0.0)
    assert m.train.tokens >= 100 and m.documents < 20


@pytest.mark.parametrize(
    "name, content, kwargs, message",
    [
        ("missing", None, {}, "no such file or directory"),
        ("empty_dir", "<dir>", {}, "no readable files found"),
        ("e.txt", "", {}, "contain no text"),
        ("x.bin", "\0", {}, "unknown format"),
        ("a.txt", "x", {"fmt": "csv"}, "--format csv: unknown format"),
        ("a.txt", "x", {"val_fraction": 1.0}, "--val-fraction"),
        ("a.jsonl", "{oops\n", {}, "a.jsonl:1: invalid JSON"),
    ],
)
def test_bad_inputs_are_one_line_errors(
    tmp_path: Path, name: str, content: str | None, kwargs: dict, message: str
) -> None:
    path = tmp_path / name
    if content == "<dir>":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        prepare_dataset([path], tmp_path / "out", "byte", **kwargs)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
