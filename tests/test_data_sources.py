"""The inputs `data prepare` reads as they are: JSON arrays, .gz (and .zst's missing-module line), a
Hugging Face `save_to_disk` folder (built here as `datasets` writes it, and by `datasets` where it is
installed), and weighted mixes: proportions within 1%, byte-equal when prepared again."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from seektrain.data import prepare_dataset
from seektrain.data.mix import interleave, parse_input
from seektrain.data.prepare import RowOptions
from seektrain.errors import UserError

ROWS = [
    {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}
    for i in range(20)
]
CHAT = RowOptions("deepseek-v3")


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "manifest.json"}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(inputs, out: Path, **kw):
    return prepare_dataset(inputs, out, "byte", val_fraction=0.0, rows=kw.pop("rows", CHAT), **kw)


def test_json_array_and_gzip_read_as_the_jsonl(tmp_path):
    ref = _jsonl(tmp_path / "a.jsonl", ROWS)
    _prepare([ref], tmp_path / "ref")
    (tmp_path / "b.json").write_text(json.dumps(ROWS, indent=2))
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(ref.read_bytes()))
    for name, path in (("json", tmp_path / "b.json"), ("gz", gz)):
        m = _prepare([path], tmp_path / name)
        assert _files(tmp_path / name) == _files(tmp_path / "ref"), name
        assert m.sources[0]["rows"] == "sharegpt"


def test_json_array_errors_name_the_line(tmp_path):
    rows = [{"text": "fine"}, {"body": "no"}]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    with pytest.raises(UserError, match=r"a.json:5: no field 'text'"):
        _prepare([tmp_path / "a.json"], tmp_path / "o")
    (tmp_path / "b.json").write_text('{"text": "an object, not an array"}')
    with pytest.raises(UserError, match="one array of rows"):
        _prepare([tmp_path / "b.json"], tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_zstd_without_the_module_is_one_line(tmp_path):
    try:
        import zstandard  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("zstandard is installed; the missing-module line cannot show")
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(UserError, match="pip install zstandard"):
        _prepare([tmp_path / "a.jsonl.zst"], tmp_path / "o")


def write_datasets_folder(folder: Path, rows: list[dict], shards: int = 2) -> Path:
    """What `Dataset.save_to_disk` writes: Arrow IPC stream shards, dataset_info.json, state.json."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    step = -(-len(rows) // shards)
    for i, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * step, step))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "features": {}}))
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def test_datasets_folder_prepares_as_its_jsonl(tmp_path):
    pytest.importorskip("pyarrow")
    _prepare([_jsonl(tmp_path / "a.jsonl", ROWS)], tmp_path / "ref")
    folder = write_datasets_folder(tmp_path / "ds", ROWS)
    m = _prepare([folder], tmp_path / "out")
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
    assert m.sources[0]["format"] == "arrow" and m.sources[0]["rows"] == "sharegpt"
    # found inside a walked directory too, as one dataset
    (tmp_path / "walk").mkdir()
    folder.rename(tmp_path / "walk" / "ds")
    _prepare([tmp_path / "walk"], tmp_path / "walked")
    assert _files(tmp_path / "walked") == _files(tmp_path / "ref")


def test_a_real_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    _prepare([_jsonl(tmp_path / "a.jsonl", ROWS)], tmp_path / "ref")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    _prepare([tmp_path / "ds"], tmp_path / "out")
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda d: (d / "data-00000-of-00001.arrow").write_bytes(b"x"), "not a Hugging Face datasets folder"),
        (lambda d: (d / "dataset_dict.json").write_text("{}"), "DatasetDict"),
        (
            lambda d: [(d / n).write_text(t) for n, t in (("state.json", "{}"), ("dataset_info.json", "{}"))],
            "_data_files",
        ),
        (
            lambda d: [
                (d / n).write_text(t)
                for n, t in (
                    ("state.json", '{"_data_files": [{"filename": "../x.arrow"}]}'),
                    ("dataset_info.json", "{}"),
                )
            ],
            "'../x.arrow'",
        ),
    ],
)
def test_a_folder_that_is_not_a_datasets_folder(tmp_path, setup, match):
    folder = tmp_path / "ds"
    folder.mkdir()
    setup(folder)
    with pytest.raises(UserError, match=match):
        _prepare([folder], tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_input_weights_parse_only_numbers(tmp_path):
    assert parse_input("a.jsonl:0.7") == ("a.jsonl", 0.7)
    assert parse_input("C:/data/a.jsonl") == ("C:/data/a.jsonl", None)
    assert parse_input("s3:bucket") == ("s3:bucket", None)
    odd = tmp_path / "run:1"
    odd.write_text("x")
    assert parse_input(str(odd)) == (str(odd), None)  # an existing path is a path
    for bad in ("a.jsonl:0", "a.jsonl:-1", "a.jsonl:nan"):
        if bad.endswith("nan"):
            assert parse_input(bad) == (bad, None)  # not a number: part of the path
            continue
        with pytest.raises(UserError, match="above 0"):
            parse_input(bad)


def test_interleave_keeps_every_prefix_within_one_document():
    out = [c for _, c in zip(range(1000), interleave([iter("a" * 10**4), iter("b" * 10**4)], [0.7, 0.3]))]
    a = 0
    for n, c in enumerate(out, 1):
        a += c == "a"
        assert abs(a - 0.7 * n) <= 1
    assert list(interleave([iter("aaa"), iter("b" * 10)], [1, 1])) == list(
        "ababab"
    )  # ends when a's turn finds none


def test_weighted_mix_proportions_and_determinism(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(8000)])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(8000)])
    inputs = [f"{a}:0.7", f"{b}:0.3"]
    m = _prepare(inputs, tmp_path / "one", rows=RowOptions())
    docs = {s["path"]: s["documents"] for s in m.sources}
    total = sum(docs.values())
    assert total >= 10_000
    assert abs(docs[str(a)] / total - 0.7) < 0.01 and abs(docs[str(b)] / total - 0.3) < 0.01
    assert [s["weight"] for s in m.sources] == [0.7, 0.3]
    _prepare(inputs, tmp_path / "two", rows=RowOptions())
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_weights_all_or_none(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    with pytest.raises(UserError, match="give every --input a weight"):
        _prepare([f"{a}:0.5", str(a)], tmp_path / "o", rows=RowOptions())


def test_cli_repeats_input_and_info_shows_the_mix(tmp_path, capsys):
    from seektrain.cli.main import main

    a = _jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(30)])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(30)])
    out = tmp_path / "o"
    assert main(["data", "prepare", "--input", f"{a}:3", "--input", f"{b}:1", "--output", str(out)]) == 0
    assert main(["data", "info", str(out)]) == 0
    assert f"mix       {a}:3 (30 documents), {b}:1 (10 documents)" in capsys.readouterr().out
