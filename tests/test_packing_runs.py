"""Through the real CLI: training on packed chat data (``data.packing = true``, loss masks from ``data
prepare``) under FSDP=2 and a 2-stage pipeline (1F1B, MTP on) is the computation of one process on the
same data: losses, gradient norms, parameters (``compare_runs.assert_same_run``) and the validation loss
over the trained tokens of the same validation rows. The in-process layout matrix on hand-built rows is in
test_packing_layouts.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from compare_runs import FP32, assert_same_run, run_layout
from seektrain.data import prepare_dataset
from seektrain.data.prepare import RowOptions


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(["fox", "dog", "lazy", "quick", "brown", "jumps", "over", "the"], size=n))


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    """240 conversations of 1-3 turns of very different lengths (byte tokenizer, DeepSeek-LLM's template),
    a tenth of them for validation."""
    root = tmp_path_factory.mktemp("chat-runs")
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(240):
        turns = []
        for _ in range(int(rng.integers(1, 4))):
            turns += [
                {"role": "user", "content": _words(rng, int(rng.integers(1, 6)))},
                {"role": "assistant", "content": _words(rng, int(rng.integers(1, 3)))},
            ]
        rows.append({"messages": turns})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_dataset(
        [root / "chat.jsonl"],
        root / "data",
        "byte",
        val_fraction=0.1,
        shard_tokens=2000,
        rows=RowOptions("deepseek-llm", max_len=64),
    )
    return str(root / "data")


def _packed(path: str) -> tuple[str, ...]:
    return (f"data.path={path}", "data.packing=true", "train.eval_interval=5", "train.eval_steps=2")


def _val_losses(run) -> list[float]:
    return [m["val_loss"] for m in run.metrics if "val_loss" in m]


# Two FSDP ranks evaluating 1 micro-batch of 2 rows each read the 4 rows one process reads in 2 (the
# loader deals a global batch's rows round-robin): the same trained tokens, so the same val_loss.
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.dp_shard=2", "train.eval_steps=1"),
        ("parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b"),
    ],
    ids=["fsdp2", "pp2-1f1b"],
)
def test_packed_chat_layout_equals_one_process(tmp_path, one_process_run, chat_data, layout):
    want = one_process_run("tiny-v3", 4, *_packed(chat_data))
    got = run_layout(tmp_path, "tiny-v3", 2, *_packed(chat_data), *layout)
    assert_same_run(got, want)
    assert len(_val_losses(want)) == 1
    assert _val_losses(got) == pytest.approx(_val_losses(want), rel=FP32.loss_rel)  # after the steps
