"""LoRA under every layout is the same computation as one process (fp32, gloo, the real `seektrain
train`, tiny-v3 with every target group, routed experts included): losses, gradient norms and every
parameter after the steps (compare_runs.py), the base unchanged, and ``layout_ran["lora"]`` showing
adapters on a frozen base where the layout puts them. The FSDP=2 × EP=2 run is also the issue's "done
when": LoRA trains through the CLI on 2 CPU processes with FSDP×EP, routed experts included.

Planted once each (docs/finetuning.md, "LoRA: low-rank adapters", lists what each caught)."""

from __future__ import annotations

import pytest
import torch

from compare_runs import assert_same_run, run_layout

LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8")
STEPS = 3


@pytest.fixture(scope="module")
def lora_reference(one_process_run):
    want = one_process_run("tiny-v3", 4, *LORA, f"train.steps={STEPS}")
    initial, _ = want.initial
    for name, value in want.weights.items():  # the base after training: bit-identical
        if "lora_" not in name:
            assert torch.equal(value, initial[name]), name
    assert any(not torch.equal(v, initial[n]) for n, v in want.weights.items() if "lora_B" in n)
    return want


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2", "parallel.dp_shard=1"),
        ("parallel.dp_shard=2",),
        ("parallel.dp_shard=2", "parallel.ep=2"),
        ("parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=2"),
    ],
    ids=["tp2", "fsdp2", "fsdp2xep2", "pp2"],
)
def test_lora_equals_one_process(tmp_path, lora_reference, layout):
    got = run_layout(tmp_path, "tiny-v3", 2, *LORA, *layout, steps=STEPS)
    assert_same_run(got, lora_reference)
