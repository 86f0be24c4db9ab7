"""Packed rows with very uneven loss masks train the same under every layout as in one process, and the
loss is the mean over the trained tokens of the whole global batch.

Why hand-built batches and the real step: the normalisation must hold across micro-batches and
data-parallel ranks whatever their trained-token counts, which only rows built for it show (one row
almost all trained, one with three trained tokens, ...; ``packed_batches.uneven_rows``). Each layout
runs ``train_step`` on a context built as the trainer builds it, 3 steps over the same global batches of
4 packed rows (positions, document ids and masks), and is compared with one process accumulating 4
micro-batches: losses, gradient norms, and every parameter's change (``compare_runs.weight_mismatches``,
with the layout tests' optimiser settings). Four ranks (no accumulation) and two ranks accumulating 2
are the normalisation's cases; TP/SP, HSDP, EP, every pipeline schedule (with MTP), selective
checkpointing and context parallelism (alone and composed) carry the positions and document ids
through their paths, and each layout's ``layout_ran`` is the one asked for (``expected_layout``). One
spawn per world size; the layouts share it."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from compare_runs import FP32, LAYOUT_SETTINGS, expected_layout, initial_weights, weight_mismatches
from packed_batches import cat_rows, uneven_rows
from spawn_ranks import spawn_ranks
from tolerances import model_rel

SEQ, ROWS, STEPS = 32, 4, 3
COMMON = (
    *LAYOUT_SETTINGS,
    f"train.seq_len={SEQ}",
    f"train.global_batch_size={ROWS}",
    "train.micro_batch_size=1",
    "precision.dtype=fp32",
    f"train.steps={STEPS}",
    "optim.warmup_steps=1",
)
# name -> (preset, world size, overrides)
LAYOUTS = {
    "one-v3": ("tiny-v3", 1, []),
    "one-v3-no-accum": ("tiny-v3", 1, ["train.micro_batch_size=4"]),
    "one-dense": ("tiny-dense", 1, []),
    "fsdp2-accum2": ("tiny-v3", 2, ["parallel.dp_shard=2"]),
    "fsdp4": ("tiny-v3", 4, ["parallel.dp_shard=4"]),
    "hsdp": ("tiny-v3", 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "ep2-fsdp4-selective": (
        "tiny-v3",
        4,
        ["parallel.dp_shard=4", "parallel.ep=2", "train.activation_checkpoint=selective"],
    ),
    "tp2-fsdp2": ("tiny-v3", 4, ["parallel.tp=2", "parallel.dp_shard=2"]),
    "tp2-fsdp2-dense": ("tiny-dense", 4, ["parallel.tp=2", "parallel.dp_shard=2"]),
    "pp2-fsdp2-1f1b": ("tiny-v3", 4, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_schedule=1f1b"]),
    "pp2-fsdp2-gpipe-full": (
        "tiny-v3",
        4,
        [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "parallel.pp_schedule=gpipe",
            "train.activation_checkpoint=full",
        ],
    ),
    "pp2-interleaved": (
        "tiny-v3",
        2,
        ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=interleaved-1f1b"],
    ),
    "pp2-zbv": ("tiny-v3", 2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=zbv"]),
    # context parallelism: documents cross the chunk boundaries, MTP targets cross them too
    "cp2": ("tiny-v3", 2, ["parallel.cp=2"]),
    "cp2-dense": ("tiny-dense", 2, ["parallel.cp=2"]),  # GQA attention (rotate-half RoPE)
    "cp2-ddp": ("tiny-v3", 2, ["parallel.cp=2", "parallel.data_parallel=ddp", "parallel.dp_shard=1"]),
    "cp2-fsdp2": ("tiny-v3", 4, ["parallel.cp=2", "parallel.dp_shard=2"]),
    "cp2-fsdp2-ep2": ("tiny-v3", 4, ["parallel.cp=2", "parallel.dp_shard=2", "parallel.ep=2"]),
    "cp2-tp2": ("tiny-v3", 4, ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"]),
    # HSDP: replicated over dp_replicate, sharded over dp_shard × cp (here the 2 cp ranks)
    "cp2-hsdp": ("tiny-v3", 4, ["parallel.cp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "cp2-pp2-1f1b": ("tiny-v3", 4, ["parallel.cp=2", "parallel.pp=2", "parallel.dp_shard=1"]),
    "cp2-pp2-gpipe-selective": (
        "tiny-v3",
        4,
        [
            "parallel.cp=2",
            "parallel.pp=2",
            "parallel.dp_shard=1",
            "parallel.pp_schedule=gpipe",
            "train.activation_checkpoint=selective",
        ],
    ),
    "cp2-pp2-interleaved-full": (
        "tiny-v3",
        4,
        [
            "parallel.cp=2",
            "parallel.pp=2",
            "parallel.dp_shard=1",
            "parallel.pp_schedule=interleaved-1f1b",
            "train.activation_checkpoint=full",
        ],
    ),
    "cp2-pp2-zbv": (
        "tiny-v3",
        4,
        ["parallel.cp=2", "parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=zbv"],
    ),
}


def global_batches(vocab: int) -> list[list]:
    """The packed rows of every step (the same on every layout)."""
    return [uneven_rows(vocab, SEQ, seed=step) for step in range(STEPS)]


def _context(plan):
    """The trainer's own ``StepContext`` (``train.trainer.build_step_context``), without the data
    pipeline: the test feeds the step its batches itself."""
    from types import SimpleNamespace

    from seektrain.parallel.mesh import build_meshes
    from seektrain.train.loss_guard import LossGuard
    from seektrain.train.startup import build_step_context

    data = SimpleNamespace(batches=iter(()))
    return build_step_context(plan, build_meshes(plan), torch.device("cpu"), data, LossGuard(), None)


def _full_parameters(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from seektrain.parallel.parallelize import unwrap

    model = unwrap(model)  # DDP's wrapper (its names start with "module.")
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().clone()
    for name, b in model.named_buffers():
        out[name.replace("_checkpoint_wrapped_module.", "")] = b.detach().clone()
    return out


def _run_layout(name: str, world: int, rank: int, out_dir: str) -> None:
    from seektrain.config.loader import load_config
    from seektrain.models.deepseek.presets import get_preset
    from seektrain.plan.run_plan import RunPlan
    from seektrain.train.step import train_step

    t0 = time.perf_counter()
    preset, _, overrides = LAYOUTS[name]
    plan = RunPlan.resolve(load_config(None, [*COMMON, *overrides]), get_preset(preset), world, "cpu")
    ctx = _context(plan)
    dp_rank = ctx.meshes.dp_rank if plan.dp > 1 else 0
    losses, norms = [], []
    for step, rows in enumerate(global_batches(plan.model.vocab_size), start=1):
        mbs = plan.job.train.micro_batch_size
        mine = [cat_rows(rows[(m * plan.dp + dp_rank) * mbs :][:mbs]) for m in range(plan.accum_steps)]
        ctx.batches = iter(mine)
        record = train_step(ctx, step)
        losses.append(float(record.values["loss"]))
        norms.append(float(record.values["grad_norm"]))
    weights = _full_parameters(ctx.model)
    torch.save(weights, os.path.join(out_dir, f"{name}-rank{rank}.pt"))
    if rank == 0:
        from seektrain.parallel.layout_record import layout_ran

        facts = {
            "layout_ran": layout_ran(ctx.parallel, ctx.meshes.world),
            "parallel": dataclasses.asdict(plan.job.parallel),
            "world": world,
            "losses": losses,
            "grad_norms": norms,
            "accum": plan.accum_steps,
            "dp": plan.dp,
            "model_config": json.dumps(plan.model.to_dict()),
            "seed": plan.job.train.seed,
            "seconds": time.perf_counter() - t0,
        }
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(facts, f)


def _worker(rank: int, out_dir: str, names: tuple[str, ...]) -> None:
    for name in names:
        _run_layout(name, dist.get_world_size(), rank, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """name -> (facts of rank 0, the union of every rank's parameters), each world size spawned once."""
    out = tmp_path_factory.mktemp("packing-layouts")
    by_world: dict[int, list[str]] = {}
    for name, (_, world, _) in LAYOUTS.items():
        by_world.setdefault(world, []).append(name)
    for world, names in by_world.items():
        spawn_ranks(functools.partial(_worker, names=tuple(names)), world, str(out))
    results = {}
    for name, (_, world, _) in LAYOUTS.items():
        weights: dict = {}
        for rank in range(world):
            weights.update(torch.load(out / f"{name}-rank{rank}.pt"))
        results[name] = (json.loads((out / f"{name}.json").read_text()), weights)
    return results


def _assert_same(got, want) -> None:
    (g, g_weights), (w, w_weights) = got, want
    ran, want = g["layout_ran"], expected_layout(g["parallel"], g["world"])  # the layout asked for ran
    assert {k: ran[k] for k in want} == want, ran
    assert (ran["cp_attention_layers"] > 0) == (want["cp"] > 1), ran
    assert g["losses"] == pytest.approx(w["losses"], rel=FP32.loss_rel, abs=FP32.loss_abs)
    assert g["grad_norms"] == pytest.approx(w["grad_norms"], rel=FP32.grad_norm_rel)
    initial, params = initial_weights(w["model_config"], w["seed"])
    assert weight_mismatches(g_weights, w_weights, initial, params, FP32) == []


def test_first_loss_is_the_token_mean_of_the_global_batch(results):
    """Step 1's loss (before any update) of one process accumulating four uneven micro-batches is the
    cross-entropy summed over all trained tokens of the 4 rows over their count (MTP: per depth)."""
    from seektrain.models import build_model
    from seektrain.models.config import ModelConfig
    from seektrain.train.loss import model_loss

    facts, _ = results["one-v3"]
    assert facts["accum"] == 4 and facts["dp"] == 1
    model = build_model(ModelConfig.from_dict(json.loads(facts["model_config"])), seed=facts["seed"])
    batch = cat_rows(global_batches(model.cfg.vocab_size)[0])
    with torch.no_grad():
        out = model(
            batch.tokens,
            mtp_tokens=batch.tokens,
            labels=batch.labels,
            positions=batch.positions,
            document_ids=batch.document_ids,
        )
    from seektrain.config.loader import load_config

    want, _ = model_loss(out, batch.labels, load_config(None, []).train.mtp_loss_weight, batch.document_ids)
    assert facts["losses"][0] == pytest.approx(float(want), rel=model_rel(model.cfg, SEQ))  # reduction order


@pytest.mark.parametrize("name", ["one-v3-no-accum", "fsdp2-accum2", "fsdp4"])
def test_loss_is_the_mean_over_the_global_batch(results, name):
    """Four ranks without accumulation, and two ranks accumulating two, equal one process accumulating
    four: a mean of per-micro-batch (or per-rank) means would weigh the row with three trained tokens
    like the row with thirty."""
    facts = results[name][0]
    assert facts["dp"] * facts["accum"] == (1 if name == "one-v3-no-accum" else 4)
    _assert_same(results[name], results["one-v3"])


@pytest.mark.parametrize(
    "name", [n for n in LAYOUTS if not n.startswith("one") and n not in ("fsdp2-accum2", "fsdp4")]
)
def test_layout_with_packing_equals_one_process(results, name):
    reference = "one-dense" if LAYOUTS[name][0] == "tiny-dense" else "one-v3"
    _assert_same(results[name], results[reference])
