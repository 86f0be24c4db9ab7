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


@pytest.mark.slow  # two more 2-rank runs; the fp32 layouts above guard the computation in CI
def test_bf16_fsdp_ep_lora_saves_and_resumes(tmp_path):
    """bf16 under FSDP=2 × EP=2: a frozen bf16 base beside fp32 adapters in one FSDP group (FSDP2 checks
    one original dtype over the trainable parameters only), saved by the current checkpoint code and
    resumed from it."""
    import json

    from run_cli import metrics, train

    common = (*LORA, "model.preset=tiny-v3", "parallel.ep=2", "precision.dtype=bf16")
    train(tmp_path, *common, "train.steps=2", nproc=2, timeout=600)
    train(tmp_path, *common, "train.steps=3", nproc=2, timeout=600)
    steps = [m["step"] for m in metrics(tmp_path)]
    assert steps[-1] == 3 and steps.count(3) == 1
    assert "resumed from" in (tmp_path / "train.log").read_text()
    lora = json.loads((tmp_path / "summary.json").read_text())["layout_ran"]["lora"]
    assert lora["base_frozen"] and lora["expert_adapter_groups"] == 4, lora
    assert lora["base_dtypes"] == ["torch.bfloat16"] and lora["adapter_dtypes"] == ["torch.float32"], lora
