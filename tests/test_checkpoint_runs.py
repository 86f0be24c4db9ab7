"""Checkpoints that never lose work, end to end through the real CLI (gloo, CPU, fp32).

One uninterrupted 2-rank FSDP run (6 steps, a checkpoint every 2) is the reference; every other run
is compared with it: resuming (bit-exact, with ``train.deterministic`` so MKL's kernels are
reproducible), falling back from a corrupt checkpoint, async saves, a worker killed with SIGKILL and
restarted by torchrun, resharding 2 ranks -> 1 process, SIGTERM, NaN losses, and export to Hugging Face.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fault_injection import hooks_env
from run_cli import TINY, metrics, train
from seektrain.checkpoint.export import read_all_tensors as load_tensors
from seektrain.models import get_preset
from tolerances import model_rel

CKPT = ["train.steps=6", "checkpoint.interval=2", "train.deterministic=true"]


def step_losses(run: Path) -> dict[int, float]:
    """Loss by step; a step logged twice (before and after a restart) keeps its last value."""
    return {m["step"]: m["loss"] for m in metrics(run)}


def same_contents(a: Path, b: Path) -> None:
    ta, tb = load_tensors(a), load_tensors(b)
    assert ta.keys() == tb.keys()
    assert [k for k in ta if not torch.equal(ta[k], tb[k])] == []
    sa, sb = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    for key in ("step", "scheduler", "scaler", "data", "faults"):
        assert sa[key] == sb[key], key


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight")
    train(run, *CKPT, nproc=2)
    return run


def test_checkpoint_holds_everything(straight):
    names = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000006"]  # checkpoint.keep = 2
    ckpt = straight / "checkpoints" / "step-00000004"
    files = {p.name for p in ckpt.iterdir()}
    assert {
        "COMPLETE",
        "checksums.json",
        "trainer_state.json",
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng-rank00000.cpu",
        "rng-rank00001.cpu",
    } <= files
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (
        state["step"] == 4
        and state["data"]["consumed_windows"] == 16
        and state["scheduler"]["last_epoch"] == 4
    )
    tensors = load_tensors(ckpt)
    biases = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert biases and all(k.startswith("model.") for k in biases)
    assert any(tensors[k].abs().sum() > 0 for k in biases)  # the balancing bias moved and was saved
    assert any(k.startswith("optim.state.") and k.endswith(".exp_avg_sq") for k in tensors)
    assert len((ckpt / "rng-rank00000.cpu").read_bytes()) == torch.get_rng_state().numel()


def test_resume_is_bit_exact_and_skips_a_corrupt_checkpoint(straight, tmp_path):
    """Same command again: the newest checkpoint (step 6) is truncated, so the run falls back to step 4
    with a warning and recomputes steps 5-6 exactly as the uninterrupted run did."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / "metrics.jsonl").unlink()
    shard = run / "checkpoints" / "step-00000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = train(run, *CKPT, nproc=2)
    out = proc.stdout + proc.stderr
    assert "step-00000006 is unusable" in out and "resumed from" in out and "step-00000004 at step 4" in out
    resumed, reference = step_losses(run), step_losses(straight)
    assert sorted(resumed) == [5, 6]
    assert [resumed[s] for s in (5, 6)] == [reference[s] for s in (5, 6)]  # bit-exact
    same_contents(run / "checkpoints" / "step-00000006", straight / "checkpoints" / "step-00000006")
    assert (run / "checkpoints" / "step-00000006.corrupt").is_dir()  # kept aside, never loaded


def test_killed_worker_is_restarted_and_async_saves_match(straight, tmp_path):
    """Rank 1 SIGKILLs itself at step 5 on the first attempt; torchrun restarts both workers, which resume
    from the last committed (async) checkpoint and finish. Async checkpoints equal sync ones."""
    run = tmp_path / "run"
    proc = train(
        run,
        *CKPT,
        "checkpoint.async_save=true",
        nproc=2,
        extra_args=("--max-restarts", "1"),
        env=hooks_env({"SEEKTRAIN_TEST_KILL": "5:1"}),
    )
    out = proc.stdout + proc.stderr
    assert "exitcode: -9" in out and "resumed from" in out
    assert step_losses(run) == step_losses(straight)
    for step in ("step-00000004", "step-00000006"):
        same_contents(run / "checkpoints" / step, straight / "checkpoints" / step)


def test_reshard_two_ranks_to_one_process(straight, tmp_path):
    """The step-4 FSDP checkpoint of 2 ranks resumes in one process (2 micro-batches of accumulation):
    same global batch (data position is global), same loss at step 5 up to reduction order."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    (run / "metrics.jsonl").unlink()
    train(run, *CKPT, "train.steps=5")
    rel = model_rel(get_preset("tiny-v3"), 64)  # the same weights: only the reduction order differs
    assert step_losses(run)[5] == pytest.approx(step_losses(straight)[5], rel=rel)


def test_sigterm_saves_a_loadable_checkpoint_and_nan_is_skipped(tmp_path):
    """SIGTERM to the launcher (torchrun forwards it): both ranks stop after the same step, save it
    and exit. A NaN loss at step 2 was skipped (train.on_bad_loss=skip) without harming the weights."""
    run = tmp_path / "run"
    args = ["train", "--nproc-per-node", "2", "--set", f"run.dir={run}"]
    for item in (*TINY, "train.steps=500", "checkpoint.interval=0"):
        args += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **hooks_env({"SEEKTRAIN_TEST_NAN": "2"})}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "seektrain.cli.main", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").is_file() and len(metrics(run)) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "preempted: stopped after step" in out, out[-3000:]
    last = max(step_losses(run))
    ckpt = run / "checkpoints" / f"step-{last:08d}"
    assert (ckpt / "COMPLETE").is_file()
    from seektrain.checkpoint.export import load_run_checkpoint

    model, path = load_run_checkpoint(run)
    assert path == ckpt
    assert all(torch.isfinite(p).all() for p in model.parameters())
    by_step = {m["step"]: m for m in metrics(run)}
    assert by_step[2]["skipped"] == 1 and by_step[2]["loss"] != by_step[2]["loss"]  # NaN
    assert by_step[3]["skipped"] == 0 and by_step[3]["loss"] < 10


def test_nan_loss_stops_with_one_line_and_saves_nothing_new(tmp_path):
    proc = train(
        tmp_path,
        "train.steps=4",
        "checkpoint.interval=1",
        "train.on_bad_loss=stop",
        env=hooks_env({"SEEKTRAIN_TEST_NAN": "2"}),
        check=False,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("seektrain:")]
    assert errors == [
        "seektrain: error: training stopped at step 2: loss is nan (train.on_bad_loss=stop); no "
        "checkpoint was written for it. Resume from the last checkpoint, e.g. with a lower "
        "optim.lr, or set train.on_bad_loss=skip"
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001"]


def test_export_to_hugging_face_matches_our_model(straight, tmp_path):
    transformers = pytest.importorskip("transformers")
    from seektrain.checkpoint.export import load_run_checkpoint
    from seektrain.cli.convert import main as convert

    assert (
        convert(
            [
                "convert",
                "--from-checkpoint",
                str(straight / "checkpoints" / "step-00000006"),
                "--to-hf",
                str(tmp_path / "hf"),
            ]
        )
        == 0
    )
    ours, _ = load_run_checkpoint(straight)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ours(tokens).logits
        assert (hf(tokens).logits - ref).abs().max().item() < 1e-4


def test_start_from_hugging_face_weights_on_two_ranks(straight, tmp_path):
    """HF folder -> weights-only step-0 checkpoint (written by one process) -> a 2-rank FSDP run loads
    it: its first loss is the loss of those weights on the first global batch."""
    from seektrain.checkpoint.export import load_run_checkpoint
    from seektrain.cli.convert import main as convert
    from seektrain.config.loader import load_config
    from seektrain.data.batch_loader import DistributedBatchLoader
    from seektrain.data.dataset import TokenDataset
    from seektrain.train.loss import model_loss
    from seektrain.train.setup_data import data_dir

    assert convert(["convert", "--from-checkpoint", str(straight), "--to-hf", str(tmp_path / "hf")]) == 0
    assert (
        convert(["convert", "--from-hf", str(tmp_path / "hf"), "--to-checkpoint", str(tmp_path / "run")]) == 0
    )
    assert (
        convert(["convert", "--from-hf", str(tmp_path / "hf"), "--to-checkpoint", str(tmp_path / "run")]) == 2
    )
    proc = train(tmp_path / "run", "train.steps=1", nproc=2)
    assert "resumed from" in proc.stdout + proc.stderr
    model, _ = load_run_checkpoint(straight)
    cfg = load_config(None, ["train.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=4"])
    loader = DistributedBatchLoader(
        TokenDataset(data_dir(cfg, True), split="train"), 64, 4, seed=cfg.train.seed
    )
    batch = next(loader)
    tokens, labels = batch.tokens, batch.labels
    with torch.no_grad():
        expected, _ = model_loss(model(tokens, mtp_tokens=tokens), labels, cfg.train.mtp_loss_weight)
    rel = model_rel(model.cfg, 64)  # 2 ranks' sum of halves vs one forward over the batch
    assert step_losses(tmp_path / "run")[1] == pytest.approx(float(expected), rel=rel)
