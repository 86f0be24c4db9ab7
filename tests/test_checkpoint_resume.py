"""``checkpoint.resume`` (auto | never | a step | a path) and the model rule, without a process group:
which checkpoint a run starts from, which model that means, what is set aside, and the one-line errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from seektrain.checkpoint.export import write_initial_checkpoint
from seektrain.checkpoint.finder import CHECKPOINTS, newest_valid
from seektrain.checkpoint.manager import CheckpointManager
from seektrain.checkpoint.resume import ResumeChoice, prepare_run_dir, resolve_resume
from seektrain.checkpoint.run_files import MODEL_CONFIG, MODEL_SOURCE, read_model_config
from seektrain.models import build_model, get_preset

DENSE, V3 = get_preset("tiny-dense"), get_preset("tiny-v3")


def make_run(run_dir: Path, steps: list[int], cfg=DENSE) -> Path:
    """A run dir as the trainer leaves it: model_config.json, metrics and one training checkpoint per step
    (weights only, which is all these rules look at)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MODEL_CONFIG).write_text(json.dumps(cfg.to_dict()))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    manager = CheckpointManager(run_dir, keep=100, async_save=False, rank=0)
    model = build_model(cfg, seed=0)
    for step in steps:
        manager.save(step, model, None, {"step": step})
    return run_dir


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:08d}"


def truncate(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------------------------ auto
def test_auto_resumes_the_newest_valid_checkpoint_and_only_reads(tmp_path):
    run = make_run(tmp_path / "run", [2, 4, 6])
    truncate(ckpt(run, 6))
    heard = []
    choice = resolve_resume(run, "auto", DENSE, on_unusable=lambda p, why: heard.append(p.name))
    # read-only, the corrupt step 6 stays and is "not in the past" of step 4; the trainer's rank 0 moves it
    # to step-00000006.corrupt first (test_checkpoint_lock.py)
    assert choice == ResumeChoice(ckpt(run, 4), DENSE, set_aside=(ckpt(run, 6),))
    assert heard == ["step-00000006"]
    assert names(run / CHECKPOINTS) == ["step-00000002", "step-00000004", "step-00000006"]  # nothing moved
    assert choice.model == DENSE and not choice.start_fresh


def test_auto_in_an_empty_run_dir_starts_fresh(tmp_path):
    choice = resolve_resume(tmp_path / "new", "auto", V3)
    assert choice == ResumeChoice(None, V3) and not choice.start_fresh
    assert prepare_run_dir(tmp_path / "new", choice) is None


# ------------------------------------------------------------------------------------------------ never
def test_never_sets_the_old_run_aside_and_keeps_it(tmp_path, caplog):
    run = make_run(tmp_path / "run", [2, 4])
    choice = resolve_resume(run, "never", V3)  # another model is fine: nothing is resumed
    assert choice.checkpoint is None and choice.model == V3 and choice.start_fresh
    assert names(run / CHECKPOINTS) == ["step-00000002", "step-00000004"]  # deciding moves nothing
    with caplog.at_level(logging.INFO, logger="seektrain.checkpoint"):
        aside = prepare_run_dir(run, choice)
    assert aside.parent == run and aside.name.startswith("checkpoints.before-") and aside.name.endswith("Z")
    lines = [r.getMessage() for r in caplog.records if "checkpoint.resume=never" in r.getMessage()]
    assert len(lines) == 1 and aside.name in lines[0] and "kept, not deleted" in lines[0]
    assert names(aside) == ["metrics.jsonl", MODEL_CONFIG, "step-00000002", "step-00000004"]
    assert names(run / CHECKPOINTS) == [] and not (run / MODEL_CONFIG).exists()
    assert not (run / "metrics.jsonl").exists()  # the new run's metrics do not continue the old ones
    assert resolve_resume(run, "auto", V3) == ResumeChoice(None, V3)
    # the set-aside checkpoints stay usable by path, with their own model
    again = resolve_resume(run, str(aside / "step-00000004"), DENSE)
    assert again.checkpoint == aside / "step-00000004" and again.model == DENSE


def test_never_in_an_unused_run_dir_moves_nothing(tmp_path):
    choice = resolve_resume(tmp_path / "run", "never", V3)
    assert not choice.start_fresh and prepare_run_dir(tmp_path / "run", choice) is None
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ a step
def test_a_step_number_resumes_it_and_sets_newer_steps_aside(tmp_path):
    run = make_run(tmp_path / "run", [2, 4, 6])
    choice = resolve_resume(run, "4", DENSE)
    assert (
        choice.checkpoint == ckpt(run, 4) and choice.set_aside == (ckpt(run, 6),) and not choice.start_fresh
    )
    aside = prepare_run_dir(run, choice)
    assert names(run / CHECKPOINTS) == ["step-00000002", "step-00000004"]
    assert names(aside) == [MODEL_CONFIG, "step-00000006"]  # a copy: the run keeps its model config
    assert read_model_config(run) == DENSE and (run / "metrics.jsonl").exists()
    assert newest_valid(run) == ckpt(run, 4)  # a later auto resume stays on the new line


def test_a_missing_or_corrupt_step_is_one_line_listing_the_steps(tmp_path):
    run = make_run(tmp_path / "run", [2, 4])
    with pytest.raises(ValueError) as err:
        resolve_resume(run, "3", DENSE)
    text = str(err.value)
    assert "\n" not in text and text.startswith("checkpoint.resume=3: ") and "available steps: 2, 4" in text
    truncate(ckpt(run, 4))
    with pytest.raises(
        ValueError,
        match=r"^checkpoint.resume=4: checkpoint step-00000004 is unusable .*"
        r"does not match its checksum.*available: 2, 4\)$",
    ):
        resolve_resume(run, "4", DENSE)
    with pytest.raises(ValueError, match=r"available steps: none"):
        resolve_resume(tmp_path / "empty", "1", DENSE)


# ------------------------------------------------------------------------------------------------ a path
def test_a_path_resumes_another_runs_checkpoint_with_that_runs_model(tmp_path):
    other = make_run(tmp_path / "other", [3], cfg=V3)
    run = make_run(tmp_path / "run", [5, 6], cfg=V3)
    choice = resolve_resume(run, str(ckpt(other, 3)), V3)
    assert choice.checkpoint == ckpt(other, 3) and choice.model == V3
    assert choice.set_aside == (ckpt(run, 5), ckpt(run, 6))  # another lineage: all of this run's
    aside = prepare_run_dir(run, choice)
    assert names(aside) == ["metrics.jsonl", MODEL_CONFIG, "step-00000005", "step-00000006"]
    assert names(other / CHECKPOINTS) == ["step-00000003"]  # the source run is only read
    assert resolve_resume(tmp_path / "x", str(other), V3).checkpoint == ckpt(
        other, 3
    )  # a run dir: its newest


def test_bad_paths_are_one_line(tmp_path):
    run = make_run(tmp_path / "run", [1])
    with pytest.raises(
        ValueError, match=r"^checkpoint.resume=.*nope: no such folder; use auto, never, a step"
    ):
        resolve_resume(run, str(tmp_path / "nope"), DENSE)
    tmp = run / CHECKPOINTS / "step-00000002.tmp"
    tmp.mkdir()
    with pytest.raises(ValueError, match=r"is not a complete checkpoint"):
        resolve_resume(run, str(tmp), DENSE)
    with pytest.raises(ValueError, match=r"holds no complete, valid checkpoint"):
        resolve_resume(run, str(tmp_path), DENSE)


# ------------------------------------------------------------------------------------------------ model rule
def test_another_model_over_a_training_checkpoint_is_refused(tmp_path):
    run = make_run(tmp_path / "run", [2])
    with pytest.raises(ValueError) as err:
        resolve_resume(run, "auto", V3)
    text = str(err.value)
    assert "\n" not in text and "holds model 'tiny-dense' but the config asks for model 'tiny-v3'" in text
    assert text.endswith("use a new run.dir, or checkpoint.resume=never to start fresh in this one")
    with pytest.raises(
        ValueError,
        match=r"'tiny-dense' \(num_hidden_layers=4\) but the config asks for model "
        r"'tiny-dense' \(num_hidden_layers=3\)",
    ):
        resolve_resume(run, "2", DENSE.replace(num_hidden_layers=3))
    renamed = DENSE.replace(name="custom")  # the same model under another label is the same model
    assert resolve_resume(run, "auto", renamed).model == DENSE


def test_a_converted_run_dir_defines_its_model(tmp_path, caplog):
    """`seektrain convert --to-checkpoint` makes a run dir whose model is no preset: the weights-only step 0
    and every later training checkpoint of that run dir resume with it, whatever model.preset says."""
    run = tmp_path / "run"
    write_initial_checkpoint(build_model(DENSE, seed=1), run, source="/hf/some-model")
    assert json.loads((run / MODEL_SOURCE).read_text())["source"] == "/hf/some-model"
    with caplog.at_level(logging.INFO, logger="seektrain.checkpoint"):
        choice = resolve_resume(run, "auto", V3)
    assert (
        choice.checkpoint == ckpt(run, 0)
        and choice.model == DENSE
        and choice.converted_from == "/hf/some-model"
    )
    assert any("converted from /hf/some-model" in r.getMessage() for r in caplog.records)
    CheckpointManager(run, keep=5, async_save=False, rank=0).save(7, build_model(DENSE), None, {"step": 7})
    assert resolve_resume(run, "auto", V3).model == DENSE  # a training checkpoint of the converted run
    # starting fresh in it takes the marker away with the checkpoints
    aside = prepare_run_dir(run, resolve_resume(run, "never", V3))
    assert MODEL_SOURCE in names(aside) and not (run / MODEL_SOURCE).exists()


def test_resuming_a_converted_checkpoint_elsewhere_marks_the_new_run_dir(tmp_path):
    source = tmp_path / "converted"
    write_initial_checkpoint(build_model(DENSE, seed=1), source, source="hf")
    run = tmp_path / "run"
    choice = resolve_resume(run, str(source), V3)
    assert choice.model == DENSE and choice.converted_from == "hf"
    prepare_run_dir(run, choice)
    assert json.loads((run / MODEL_SOURCE).read_text())["source"] == "hf"


# ------------------------------------------------------------------------------------------------ 2 ranks
def _two_ranks(rank: int, out_dir: str) -> None:
    out = Path(out_dir)
    manager = CheckpointManager(out / "run", keep=5, async_save=False, rank=rank)
    lines = []
    try:
        manager.resume_choice("auto", V3)
    except ValueError as err:
        lines.append(f"refused: {err}")
    choice = manager.resume_choice("never", V3)
    lines.append(f"never: {choice.checkpoint} {choice.start_fresh}")
    (out / f"rank{rank}.txt").write_text("\n".join(lines))


def test_every_rank_gets_rank_0s_decision(tmp_path):
    """``CheckpointManager.resume_choice`` on 2 gloo ranks: rank 0 decides and acts, both ranks raise the
    same one-line error, and `never` sets the checkpoints aside once."""
    from spawn_ranks import spawn_ranks

    run = make_run(tmp_path / "run", [2])
    spawn_ranks(_two_ranks, 2, str(tmp_path))
    said = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    assert said[0] == said[1] and len(said[0]) == 2
    assert said[0][0].startswith("refused: checkpoint ") and "holds model 'tiny-dense'" in said[0][0]
    assert said[0][1] == "never: None True"
    assert len(list(run.glob("checkpoints.before-*/step-00000002"))) == 1
