"""The trainer's logged loss against a loss computed by hand (issue 35): rows of one document each, with
a prompt (masked), a trained answer and padding, whose trained-token counts differ across micro-batches
and ranks (15, 3, 12 and 1 of 16 positions). The expected step-1 loss is computed here without
``seektrain.train.loss``: the plain model's logits (the initial weights, as the trainer builds them),
``log_softmax``, the value at each trained target gathered, summed over every row of the global batch and
divided by the number of trained targets of the whole global batch (docs/training.md, "Loss"). The
trainer's ``train_step`` (what metrics.jsonl logs as ``loss``) must equal it for one process
accumulating 4 micro-batches of one row or 2 of two rows, and for 2 data-parallel ranks accumulating 2."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.distributed as dist

from seektrain.data.batch import Batch
from seektrain.models.config import ModelConfig
from seektrain.models.linear_cross_entropy import IGNORE
from spawn_ranks import spawn_ranks
from tolerances import model_rel

SEQ, PAD = 16, 0
# (document length, prompt length) of each row; the rest of the row is padding. Targets trained: the
# answer's tokens, predicted from position prompt-1 on: 15, 3, 12 and 1.
ROWS = [(16, 1), (9, 6), (14, 2), (11, 10)]
TRAINED = [15, 3, 12, 1]
COMMON = (
    f"train.seq_len={SEQ}",
    f"train.global_batch_size={len(ROWS)}",
    "precision.dtype=fp32",
    "train.steps=1",
    "optim.warmup_steps=1",
)
# name -> (world size, overrides)
LAYOUTS = {
    "one-accum4": (1, ["train.micro_batch_size=1"]),
    "one-accum2": (1, ["train.micro_batch_size=2"]),
    "fsdp2-accum2": (2, ["train.micro_batch_size=1", "parallel.dp_shard=2"]),
}


def rows(vocab: int) -> Batch:
    """[4, SEQ] tokens and labels: IGNORE on the prompt's targets, the document's last token and padding."""
    gen = torch.Generator().manual_seed(35)
    tokens = torch.full((len(ROWS), SEQ), PAD)
    labels = torch.full((len(ROWS), SEQ), IGNORE)
    for r, (length, prompt) in enumerate(ROWS):
        tokens[r, :length] = torch.randint(1, vocab, (length,), generator=gen)
        labels[r, prompt - 1 : length - 1] = tokens[r, prompt:length]
    assert (labels != IGNORE).sum(1).tolist() == TRAINED
    return Batch(tokens, labels)


def _worker(rank: int, out_dir: str, names: tuple[str, ...]) -> None:
    from types import SimpleNamespace

    from seektrain.config.loader import load_config
    from seektrain.models.deepseek.presets import get_preset
    from seektrain.parallel.mesh import build_meshes
    from seektrain.plan.run_plan import RunPlan
    from seektrain.train.loss_guard import LossGuard
    from seektrain.train.startup import build_step_context
    from seektrain.train.step import train_step

    world = dist.get_world_size()
    for name in names:
        overrides = LAYOUTS[name][1]
        plan = RunPlan.resolve(
            load_config(None, [*COMMON, *overrides]), get_preset("tiny-dense"), world, "cpu"
        )
        data = SimpleNamespace(batches=iter(()))
        ctx = build_step_context(plan, build_meshes(plan), torch.device("cpu"), data, LossGuard(), None)
        dp_rank = ctx.meshes.dp_rank if plan.dp > 1 else 0
        batch, mbs = rows(plan.model.vocab_size), plan.job.train.micro_batch_size
        # the loader's rule: row j of the global batch goes to rank j % dp (docs in data/batch_loader.py)
        mine = [
            list(range(len(ROWS)))[dp_rank + m * plan.dp * mbs :][: mbs * plan.dp : plan.dp]
            for m in range(plan.accum_steps)
        ]
        ctx.batches = iter([Batch(batch.tokens[idx], batch.labels[idx]) for idx in mine])
        record = train_step(ctx, 1)
        if rank == 0:
            facts = {
                "loss": float(record.values["loss"]),
                "lm_loss": float(record.values["lm_loss"]),
                "accum": plan.accum_steps,
                "dp": plan.dp,
                "rows": mine,
                "model_config": json.dumps(plan.model.to_dict()),
                "seed": plan.job.train.seed,
            }
            with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                json.dump(facts, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("loss-oracle")
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = tuple(n for n, (w, _) in LAYOUTS.items() if w == world)
        spawn_ranks(functools.partial(_worker, names=names), world, str(out))
    return {name: json.loads((out / f"{name}.json").read_text()) for name in LAYOUTS}


def expected_loss(model_config: str, seed: int) -> float:
    """By hand: sum over the trained targets of -log_softmax(logits)[target], over their count."""
    from seektrain.models import build_model

    model = build_model(ModelConfig.from_dict(json.loads(model_config)), seed=seed)
    batch = rows(model.cfg.vocab_size)
    with torch.no_grad():
        logits = model(batch.tokens).logits.double()  # [4, SEQ, V]
    logp = torch.log_softmax(logits, dim=-1)
    total, count = 0.0, 0
    for r in range(len(ROWS)):
        for t in range(SEQ):
            target = int(batch.labels[r, t])
            if target != IGNORE:
                total -= float(logp[r, t, target])
                count += 1
    assert count == sum(TRAINED)
    return total / count


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logged_loss_is_the_hand_computed_mean_over_trained_tokens(results, name):
    facts = results[name]
    world = LAYOUTS[name][0]
    assert facts["dp"] == world and facts["dp"] * facts["accum"] * (len(facts["rows"][0])) == len(ROWS)
    want = expected_loss(facts["model_config"], facts["seed"])
    assert facts["lm_loss"] == facts["loss"]  # no MTP, no auxiliary loss in the logged loss
    cfg = ModelConfig.from_dict(json.loads(facts["model_config"]))
    rel = model_rel(cfg, SEQ)  # fp64 oracle over the fp32 logits vs the trainer's fp32 loss
    assert facts["loss"] == pytest.approx(want, rel=rel), (
        f"{name}: trainer loss {facts['loss']:.6f}, hand-computed mean over {sum(TRAINED)} trained tokens "
        f"{want:.6f} (rank 0's micro-batches: rows {facts['rows']})"
    )
