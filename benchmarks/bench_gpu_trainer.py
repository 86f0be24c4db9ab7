"""The trainer rows of bench_gpu.py: the real ``seektrain train`` on the benchmark's model, its figures
read from the run's ``metrics.jsonl``.

The trainer runs as users run it (``python -m seektrain.cli.main train --set ...``), from the Hugging Face
folder the bare-model rows wrote (``model.hf_path``), on one rank: the run plan trains the plain model
there (FSDP wraps only when there is more than one data-parallel rank, or with CPU offload), with fp32
master weights, bf16 autocast, fused AdamW and gradient clipping, on a prepared dataset of random
tokens (``prepare_data``). Once the record of its last step is in ``metrics.jsonl`` the process group of the run
is killed: its end-of-run checkpoint (tens of GB for these models, minutes of disk and hashing) is not
what these rows measure, and the checkpoint rows time saving on their own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_gpu_common import ROOT, Results, run_row

FP8_RECIPE = "rowwise"
_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def prepare_data(target: Path, args, vocab_size: int) -> Path:
    """A prepared dataset of uniformly random token ids over the whole vocabulary, as the bare-model rows
    draw theirs (for a MoE model the token distribution decides the experts' loads, so the trainer rows
    see the same kind of batches), with twice the tokens the trainer rows read. Made with
    ``seektrain data prepare``'s own code from a word-level tokenizer.json whose word ``w<i>`` is id i
    (``</s>`` the last id, the end of each document) and JSONL documents of random words: no download,
    no dependence on what the machine's Python ships."""
    import json as _json

    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    from seektrain.data.prepare import prepare_dataset

    src = target.with_name(target.name + "-src")
    src.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["</s>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(src / "tokenizer.json"))
    need = max(2 * (args.warmup + args.iters) * args.batch * (args.seq + 1), 1 << 16)
    docs = 100
    ids = np.random.default_rng(0).integers(0, vocab_size - 1, size=need + docs)
    with open(src / "docs.jsonl", "w") as f:
        for chunk in np.array_split(ids, docs):
            f.write(_json.dumps({"text": " ".join(f"w{i}" for i in chunk.tolist())}) + "\n")
    prepare_dataset([src / "docs.jsonl"], target, str(src / "tokenizer.json"), fmt="jsonl", force=True)
    return target


def fp8_unavailable(device: torch.device) -> str | None:
    """Why the FP8 row cannot run here, or None: the config key must exist and accept the recipe, torchao
    must be importable, and the GPU must have FP8 tensor cores (compute capability 8.9+)."""
    from seektrain.config.loader import load_config
    from seektrain.config.schema import PrecisionSection

    if "fp8" not in {f.name for f in dataclasses.fields(PrecisionSection)}:
        return "precision.fp8 is not a config key in this checkout (seektrain/config/schema.py)"
    try:
        load_config(None, [f"precision.fp8={FP8_RECIPE}"])
    except ValueError as err:
        return f"the config refuses precision.fp8={FP8_RECIPE}: {err}"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (on the lent GPU carry its wheel: docs/benchmarks.md)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 matmuls need a CUDA GPU of compute capability 8.9 or newer"
    return None


def child_env() -> dict[str, str]:
    """This environment for the trainer process, less any torch.distributed variables (this process
    may hold a single-rank process group, and the trainer must start its own), with this checkout first
    on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def read_records(path: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl being written."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the trainer's own process group (it was started in a new session: its compile workers go
    too, nothing else)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_trainer(run_dir: Path, overrides: list[str], steps: int, timeout_s: float) -> dict:
    """Start the trainer, wait for its last step's record, stop it; the records, how it ended, its log."""
    log_path = run_dir.with_suffix(".log")
    cmd = [sys.executable, "-m", "seektrain.cli.main", "train"]
    for item in overrides:
        cmd += ["--set", item]
    deadline = time.monotonic() + timeout_s
    ended = "exited"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while proc.poll() is None:
                records = read_records(run_dir / "metrics.jsonl")
                if records and records[-1].get("step", 0) >= steps:
                    ended = "stopped after its last step (before its end-of-run checkpoint)"
                    break
                if time.monotonic() > deadline:
                    ended = f"stopped: no step {steps} within --trainer-timeout {timeout_s:.0f} s"
                    break
                time.sleep(0.25)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    return {
        "records": read_records(run_dir / "metrics.jsonl"),
        "returncode": proc.returncode,
        "ended": ended,
        "log_tail": lines[-15:],
        "command": " ".join(cmd),
    }


def summarise(run: dict, steps: int, warmup: int, flops_per_token: float, peak: float | None) -> dict:
    """Medians over the steps after warm-up of what the trainer logged (tokens_per_s; mfu, against the
    peak seektrain.observe.flops gives: the same datasheet figure on a known GPU, a separate probe on a
    CPU), and its peak memory (CUDA max_memory_allocated since the run began, or peak resident memory on
    a CPU). ``mfu_at_bench_peak`` puts the same tokens/s against the other rows' peak."""
    records = run["records"]
    if not records or records[-1].get("step", 0) < steps:
        last = run["log_tail"][-1] if run["log_tail"] else "no output"
        return {
            "error": f"the trainer logged {len(records)} of {steps} steps, {run['ended']} "
            f"(exit code {run['returncode']}): {last}",
            "log_tail": run["log_tail"],
            "command": run["command"],
        }
    steady = [r for r in records if r["step"] > warmup] or records
    peaks = [r.get("mem_peak_gib", r.get("mem_peak_rss_gib")) for r in records]
    peaks = [p for p in peaks if p is not None]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady)
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": statistics.median(r["mfu"] for r in steady),
        "mfu_at_bench_peak": tokens_per_s * flops_per_token / peak if peak else None,
        "peak_mem_gib": max(peaks) if peaks else None,
        "step_s_median": statistics.median(r["step_time_s"] for r in steady),
        "step_s": [r["step_time_s"] for r in steady],
        "first_step_s": records[0]["step_time_s"],
        "loss_first": records[0].get("loss"),
        "loss_last": records[-1].get("loss"),
        "ended": run["ended"],
        "command": run["command"],
        "note": "read from metrics.jsonl: tokens/s of the whole optimizer step; first_step_s includes compilation",
    }


def trainer_rows(
    results: Results,
    key: str,
    hf_dir: Path,
    data_dir: Path,
    work: Path,
    args,
    device: torch.device,
    selected: set[str],
) -> None:
    steps = args.warmup + args.iters
    common = [
        f"model.hf_path={hf_dir}",
        f"data.path={data_dir}",
        f"train.steps={steps}",
        f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={args.batch}",
        f"train.seq_len={args.seq}",
        "precision.dtype=bf16",
        f"train.compile={str(args.trainer_compile).lower()}",
        "checkpoint.interval=0",
        "train.eval_interval=0",
        "metrics.tensorboard=false",
        "run.progress_bar=false",
        "run.log_interval=1",
    ]
    variants = (
        ("trainer_bf16", [], None),
        (
            "trainer_fp8",
            [f"precision.fp8={FP8_RECIPE}"],
            fp8_unavailable(device) if "trainer_fp8" in selected else None,
        ),
    )
    for row, extra, unavailable in variants:
        if unavailable:
            results.row(key, row, {"skipped": unavailable})
            continue
        run_dir = work / f"run-{key}-{row}"

        def one(run_dir=run_dir, extra=extra):
            run = run_trainer(run_dir, [f"run.dir={run_dir}", *common, *extra], steps, args.trainer_timeout)
            return summarise(
                run,
                steps,
                args.warmup,
                results.data["models"][key]["flops_per_token"],
                results.data["device"]["peak_bf16_flops"],
            )

        try:
            run_row(results, key, row, selected, one, device)
        finally:
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
