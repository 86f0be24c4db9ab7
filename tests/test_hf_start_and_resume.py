"""A run started from a Hugging Face folder (FSDP=2, each rank its own slices) logs what it read; its
resume from its own checkpoint reads no tensor of the folder (only config.json and the headers, which
say whether the model changed); a LoRA resume reads its base again, slice by slice."""

from __future__ import annotations

import re

from run_cli import metrics, train
from seektrain.models import build_model, get_preset
from seektrain.models.deepseek.hf_io import save_pretrained

READ = re.compile(r"model\.hf_path=\S+: read [0-9.]+ GB into \d+ local tensors in [0-9.]+ s \([0-9.]+ GB/s")


def _reads(run) -> int:
    return len(READ.findall((run / "train.log").read_text()))


def test_start_reads_slices_and_resume_reads_none(tmp_path):
    folder = tmp_path / "hf"
    save_pretrained(build_model(get_preset("tiny-v3"), seed=5), folder, max_shard_bytes=400_000)
    common = (f"model.hf_path={folder}", "parallel.dp_shard=2", "checkpoint.interval=2")
    full, lora = tmp_path / "full", tmp_path / "lora"
    train(full, *common, "train.steps=2", nproc=2)
    train(lora, *common, "lora.enabled=true", "train.steps=2", nproc=2)
    assert _reads(full) == 1 and _reads(lora) == 1  # rank 0's line (train.log is rank 0's)
    train(full, *common, "train.steps=3", nproc=2)
    train(lora, *common, "lora.enabled=true", "train.steps=3", nproc=2)
    assert _reads(full) == 1, "the full fine-tune's resume read the Hugging Face folder again"
    assert _reads(lora) == 2, "the LoRA resume did not read its base"
    assert [m["step"] for m in metrics(full) if "loss" in m][-1] == 3
