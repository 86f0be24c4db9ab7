"""Every bad input gets one line, and nothing the user has is lost (issue 16).

Each row of ``bad_input_cases.ROWS`` runs one command against one bad input and checks: the exit code,
that stderr is exactly one line naming the key, flag or file at fault, that no traceback is printed, and
that every file that existed before (the row's own folder and the shared fixtures) is byte-identical
afterwards. The rows run in this process through ``seektrain.cli.main.main(argv)`` (the CLI imports
torch once, not once per row); only rows that need the launcher and its workers start processes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from bad_input_cases import ROWS, Case
from run_cli import seektrain
from seektrain.cli.main import main

CORPUS = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(300))


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> dict:
    """Shared, read-only inputs: a prepared data folder, a run dir with a trained step-1 checkpoint,
    a Hugging Face folder of tiny-dense and a tokenizer folder."""
    root = tmp_path_factory.mktemp("fixtures")
    (root / "corpus.txt").write_text(CORPUS)
    assert main(["data", "prepare", "--input", str(root / "corpus.txt"), "--output", str(root / "data")]) == 0
    assert main(["convert", "--preset", "tiny-dense", "--to-hf", str(root / "hf")]) == 0
    _tokenizer(root / "tok")
    seektrain(
        "train",
        "--set",
        f"run.dir={root / 'run'}",
        "--set",
        f"data.path={root / 'data'}",
        "--set",
        "model.preset=tiny-dense",
        "--set",
        "train.steps=1",
        "--set",
        "train.seq_len=32",
        "--set",
        "train.global_batch_size=2",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "precision.dtype=fp32",
        "--set",
        "checkpoint.interval=1",
        "--set",
        "train.eval_interval=0",
        "--set",
        "run.progress_bar=false",
        "--set",
        "metrics.tensorboard=false",
    )
    return {name: root / name for name in ("data", "run", "hf", "tok")}


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", *sorted(set(CORPUS.split()))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')


def _snapshot(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _run(case: Case, ws: Path, fx: dict, capsys) -> tuple[int, str]:
    argv = [a.format(ws=ws, **fx) for a in case.argv]
    if case.subprocess:
        proc = seektrain(*argv, cwd=ws, check=False)
        return proc.returncode, proc.stderr
    cwd = os.getcwd()
    os.chdir(ws)  # a relative default (run.dir = runs/default) lands in the row's folder
    try:
        capsys.readouterr()
        code = main(argv)
    finally:
        os.chdir(cwd)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", ROWS, ids=[c.id for c in ROWS])
def test_bad_input(case: Case, fx, tmp_path, capsys):
    ws = tmp_path / "ws"
    ws.mkdir()
    if case.setup:
        case.setup(ws, fx)
    before = _snapshot(ws, *fx.values())
    code, err = _run(case, ws, fx, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert code == case.code, err
    if case.code == 0:
        assert not [line for line in lines if "error" in line], err
    else:
        assert len(lines) == 1 and lines[0].startswith("seektrain"), err
        for name in case.names:
            assert name.format(ws=ws, **fx) in lines[0], f"{name!r} not named in: {lines[0]}"
    after = _snapshot(ws, *fx.values())
    changed = [p for p, digest in before.items() if after.get(p) != digest]
    assert not changed, f"changed or deleted: {changed}"
    if case.argv[:2] == ["data", "prepare"] and case.code:
        made = sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if str(p) not in before and p.is_file())
        assert not made, f"a failed prepare left {made}"  # nothing half-written
    shutil.rmtree(ws, ignore_errors=True)


def test_rows_cover_every_area():
    assert len(ROWS) > 100
    kinds = {c.argv[0] for c in ROWS}
    assert {"train", "config", "sample", "flops", "data", "convert"} <= kinds


def test_internal_error_is_one_line_naming_train_log(tmp_path, monkeypatch, capsys):
    """A bug (not a user mistake) puts its traceback into run.dir/train.log and one line on stderr."""
    from seektrain.cli import train_cmd

    def broken(args):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(train_cmd, "run", broken)
    assert main(["train", "--set", f"run.dir={tmp_path / 'run'}"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1
        and str(tmp_path / "run" / "train.log") in lines[0]
        and "an invariant broke" in lines[0]
    )
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Traceback" in log and "RuntimeError: an invariant broke" in log


def test_launcher_prints_each_worker_line_once(tmp_path, capsys):
    """Four ranks refusing the same bad input give one line (exit 2); a rank that died silently is named."""
    from types import SimpleNamespace

    from seektrain.launch.worker_errors import report_failures

    line = "seektrain: error: data.path=x: no such directory"
    for rank in range(4):
        (tmp_path / f"rank-{rank}.txt").write_text(line)
    same = {r: SimpleNamespace(exitcode=2) for r in range(4)}
    assert report_failures(same, tmp_path) == 2
    assert capsys.readouterr().err.splitlines() == [line + " [ranks 0, 1, 2, 3]"]
    (tmp_path / "rank-1.txt").unlink()
    mixed = {0: SimpleNamespace(exitcode=2), 1: SimpleNamespace(exitcode=-9)}
    assert report_failures(mixed, tmp_path) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == line + " [rank 0]" and "rank 1 (exit code -9)" in err[1]


def _train_in_process(run: Path, fx: dict) -> list[str]:
    return [
        "train",
        "--set",
        f"run.dir={run}",
        "--set",
        f"data.path={fx['data']}",
        "--set",
        "model.preset=tiny-dense",
        "--set",
        "train.steps=2",
        "--set",
        "train.seq_len=32",
        "--set",
        "train.global_batch_size=2",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "precision.dtype=fp32",
        "--set",
        "train.eval_interval=0",
        "--set",
        "run.progress_bar=false",
        "--set",
        "metrics.tensorboard=false",
    ]


def test_bad_input_found_inside_the_step_is_one_line_exit_2(fx, tmp_path, monkeypatch, capsys):
    """Bad input is a ``UserError`` wherever it is found, even inside a step: one line, exit 2, no traceback."""
    from seektrain.errors import UserError
    from seektrain.train import trainer

    def refuses(ctx, step):
        raise UserError("data.path=x: shard 3 holds token 70000, above the vocabulary; re-run data prepare")

    monkeypatch.setattr(trainer, "train_step", refuses)
    assert main(_train_in_process(tmp_path / "run", fx)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "seektrain: error: data.path=x: shard 3 holds token 70000, above the vocabulary; re-run data prepare"
    ]
    assert "Traceback" not in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("bug", [TypeError, ValueError])
def test_bug_inside_the_step_is_an_internal_error_with_its_traceback_in_train_log(
    bug, fx, tmp_path, monkeypatch, capsys
):
    """A bug in the step (a ValueError too: not every ValueError is the user's) is no "user error": exit 1,
    one line saying it is internal and naming run.dir/train.log, which holds the whole traceback."""
    from seektrain.train import trainer

    def broken_step(ctx, step):
        raise bug("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")

    monkeypatch.setattr(trainer, "train_step", broken_step)
    assert main(_train_in_process(tmp_path / "run", fx)) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    log = tmp_path / "run" / "train.log"
    assert len(lines) == 1 and lines[0].startswith("seektrain: internal error: ") and str(log) in lines[0], (
        lines
    )
    text = log.read_text()
    assert "Traceback" in text and "in broken_step" in text and f"{bug.__name__}: unsupported operand" in text
