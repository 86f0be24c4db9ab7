"""The training step never reads a device value on the host except at flush steps.

A read (``.item()``, ``float()``, ``bool()``, ``.tolist()``, ``.cpu()``, ``.to("cpu")``, ...) of a GPU
tensor waits for the device to finish everything queued before it, and so does an operation whose output
size depends on the values (``nonzero``, ``masked_select``, a boolean-mask index). ``host_reads.py`` counts
the reads made in each iteration of a
tiny in-process run's training loop (generic platform policy, i.e. the GPU path's kernels); only the
flush steps (every ``run.log_interval``, the first and the last) may read. The runs cover MLA + MoE +
MTP with the spike guard on, and a dense model under fp16 loss scaling with overflowing first steps.
Expert parallelism's all-to-all splits (a read per MoE layer, needed to size the exchange) need ``ep > 1``,
hence several processes, and are not covered here. Reads inside torch's C++ are invisible to this count
on a CPU; on a GPU machine the run also counts what ``torch.cuda.set_sync_debug_mode`` reports. A negative control
plants one read of each kind after every step and checks that the count reports them all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TINY = [
    "train.seq_len=64",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "checkpoint.interval=0",
    "run.progress_bar=false",
    "metrics.tensorboard=false",
    "train.eval_interval=0",
    "checkpoint.resume=never",
    "train.steps=7",
    "run.log_interval=3",
]
FLUSH_STEPS = {1, 3, 6, 7}


def _reads(run_dir: Path, overrides: list[str], *flags: str) -> dict[int, list[str]]:
    args = [a for item in (*TINY, *overrides) for a in ("--set", item)]
    proc = subprocess.run(
        [sys.executable, str(HERE / "host_reads.py"), str(run_dir), *flags, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1])["reads"].items()}


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.preset=tiny-v3", "precision.dtype=fp32", "train.spike_factor=3"],
        ["model.preset=tiny-dense", "precision.dtype=fp16", "precision.loss_scale_init=1048576"],
    ],
    ids=["tiny-v3-moe-mtp", "tiny-dense-fp16"],
)
def test_only_flush_steps_read_device_values(tmp_path, overrides):
    reads = _reads(tmp_path, overrides)
    assert {step: r for step, r in reads.items() if step not in FLUSH_STEPS} == {}
    assert all(any("step_log.py" in r for r in reads[step]) for step in FLUSH_STEPS)  # the count sees reads
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))  # every step is still logged
    if "precision.dtype=fp16" in overrides:
        assert records[0]["skipped"] == 1 and records[0]["loss_scale"] == 1048576 / 2


def test_a_planted_read_of_each_kind_is_reported(tmp_path):
    """The negative control: ``.cpu()``, ``.to("cpu")``, ``nonzero``, ``masked_select`` and a boolean-mask
    index of the step's loss, after every step (host_reads.py ``--plant``), are each reported on every
    step, not only the flush steps."""
    from host_reads import PLANTED

    reads = _reads(
        tmp_path,
        ["model.preset=tiny-dense", "precision.dtype=fp32", "train.steps=2", "run.log_interval=1"],
        "--plant",
    )
    assert sorted(reads) == [1, 2]
    for step, found in reads.items():
        for kind in PLANTED:
            assert any(r.startswith(f"{kind} at trainer.py") for r in found), (step, kind, found)
