"""Expert parallelism over tensor-parallel ranks, and with pipeline stages, is the same computation as
one process (fp32, gloo, the real `seektrain train`): losses, global gradient norms, balancing statistics
and every parameter and balancing bias after 5 steps with the V3 balancing-bias update (compare_runs.py);
plus who holds which expert shard on 4 ranks.

(Measured before the parameter comparison existed: scaling tp×ep's expert gradients by 1/2 moved no loss
by 1e-5 but every gradient norm by ~0.5%: losses alone do not see a mis-scaled expert gradient.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from compare_runs import assert_same_run, run_layout
from spawn_ranks import spawn_ranks

CLIP_NORM = 1.0  # tiny-v2's and tiny-v3's gradient norms are 3-7 over the 5 steps
CLIP = f"train.grad_clip={CLIP_NORM}"


def clipped_reference(one_process_run, model: str):
    """The one-process run with ``CLIP``, which clips every step (its gradient norm stays above it)."""
    want = one_process_run(model, 4, CLIP)
    assert min(m["grad_norm"] for m in want.metrics) > 2 * CLIP_NORM, "the clipping would not be active"
    return want


@pytest.mark.parametrize("model", ["tiny-v2", "tiny-v3"])
def test_tp2_x_ep2(tmp_path, one_process_run, model):
    """2 ranks: one tp group, which is also the ep group (no FSDP: a single data-parallel rank); with
    active clipping (the global norm over tp- and ep-sharded gradients)."""
    got = run_layout(tmp_path, model, 2, "parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=1", CLIP)
    assert_same_run(got, clipped_reference(one_process_run, model))


def test_dp2_x_tp2_x_ep4(tmp_path, one_process_run):
    """4 ranks: every rank of both tp groups in one ep group; each expert on one rank (efsdp = 1)."""
    got = run_layout(tmp_path, "tiny-v3", 4, "parallel.tp=2", "parallel.ep=4", "parallel.dp_shard=2")
    assert_same_run(got, one_process_run("tiny-v3"))


def test_dp4_x_ep2_fsdp_sharded_experts(tmp_path, one_process_run):
    """4 ranks, FSDP=4 × EP=2: each expert's weights FSDP-sharded over the 2 ranks of its efsdp group
    (efsdp = 2), one sequence per rank."""
    got = run_layout(
        tmp_path, "tiny-v3", 4, "parallel.ep=2", "parallel.dp_shard=4", "train.micro_batch_size=1"
    )
    assert_same_run(got, one_process_run("tiny-v3"))


def test_dp2_x_tp2_x_ep2(tmp_path, one_process_run):
    """4 ranks: each tp group is an ep group; expert shards FSDP-sharded over the 2 dp_shard ranks."""
    got = run_layout(tmp_path, "tiny-v3", 4, "parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=2")
    assert_same_run(got, one_process_run("tiny-v3"))


def test_pp2_x_dp2_x_ep2(tmp_path, one_process_run):
    """4 ranks: 2 pipeline stages (1F1B, 2 micro-batches of 1 sequence), each an FSDP=2 × EP=2 group; with
    active clipping (the global norm summed over the pipeline stages)."""
    got = run_layout(
        tmp_path,
        "tiny-v3",
        4,
        "parallel.pp=2",
        "parallel.ep=2",
        "parallel.dp_shard=2",
        "parallel.pp_microbatches=2",
        CLIP,
    )
    assert_same_run(got, clipped_reference(one_process_run, "tiny-v3"))


# ------------------------------------------------------------------------------ shards per rank
WORLD = 4
LAYOUTS = {"ep4": 4, "ep2": 2, "ep1": 1}  # all dp_shard=2 × tp=2


def _one_step_biases(model, plan, meshes) -> list[list[float]]:
    """One forward/backward on this dp rank's own batch, then the V3 balancing-bias update the trainer
    does (counts all-reduced over the dp ranks): every rank must end up with the same biases."""
    from seektrain.train.balance import (
        collect_expert_load,
        configure_aux_loss,
        moe_layers,
        update_balance_bias,
    )
    from seektrain.train.loss import model_loss

    configure_aux_loss(model, 1e-2, 1.0)
    dp = meshes.dp
    gen = torch.Generator().manual_seed(dp.get_local_rank())  # tp peers share a batch
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=gen)
    with plan.loss_context():
        loss, _ = model_loss(model(tokens, mtp_tokens=tokens), tokens, 0.3)
        loss.backward()
    update_balance_bias(model, collect_expert_load(model, dp.get_group()), 1e-2)
    return [m.gate.e_score_correction_bias.tolist() for m in moe_layers(model)]


def _worker(rank: int, out_dir: str) -> None:
    from torch.distributed.tensor import DTensor

    from seektrain.config.loader import load_config
    from seektrain.models import build_model
    from seektrain.models.deepseek.presets import get_preset
    from seektrain.parallel.mesh import build_meshes
    from seektrain.parallel.parallelize import parallelize_model
    from seektrain.plan.run_plan import RunPlan

    result = {}
    for name, ep in LAYOUTS.items():
        job = load_config(None, ["parallel.dp_shard=2", "parallel.tp=2", f"parallel.ep={ep}"])
        plan = RunPlan.resolve(job, get_preset("tiny-v3"), WORLD, "cpu")
        meshes = build_meshes(plan)
        model = parallelize_model(
            build_model(plan.model, device="meta"), plan, meshes, torch.device("cpu")
        ).model
        numel = {"expert": [0, 0], "other": [0, 0]}  # [held by this rank, in the model]
        for pname, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            kind = "expert" if ".experts." in pname else "other"
            numel[kind][0] += local.numel()
            numel[kind][1] += p.numel()
        result[name] = numel
        expert = model.get_parameter("layers.1.mlp.experts.gate_up_proj")  # a DTensor: FSDP's mesh × EP's
        result[name]["expert_mesh"] = [
            list(expert.device_mesh.mesh_dim_names),
            list(expert.device_mesh.shape),
        ]
        if ep > 1:
            result[name]["groups"] = {
                "ep": dist.get_process_group_ranks(meshes.ep.get_group()),
                "efsdp": dist.get_process_group_ranks(meshes.efsdp.get_group()),
            }
            result[name]["biases"] = _one_step_biases(model, plan, meshes)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("shards")
    spawn_ranks(_worker, WORLD, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_expert_groups_on_the_world_mesh(shards):
    """Ranks are (dp_shard, tp) = (r // 2, r % 2). ep=4 takes both tp groups; ep=2 is one tp group,
    and the other dp_shard rank holding the same experts is the FSDP peer."""
    for r, result in enumerate(shards):
        assert result["ep4"]["groups"] == {"ep": [0, 1, 2, 3], "efsdp": [r]}
        assert result["ep2"]["groups"] == {"ep": [r - r % 2, r - r % 2 + 1], "efsdp": [r % 2, r % 2 + 2]}


@pytest.mark.parametrize("layout", ["ep4", "ep2"])
def test_balancing_biases_identical_on_every_rank(shards, layout):
    """Every tp rank routes the whole gathered sequence, so the expert counts, and the biases updated
    from them, agree on all 4 ranks, although tp peers dispatch different tokens."""
    biases = [result[layout]["biases"] for result in shards]
    assert len(biases[0]) == 4  # tiny-v3: 3 MoE layers + the MTP block
    assert all(b == biases[0] for b in biases[1:])
    assert any(any(v != 0 for v in layer) for layer in biases[0])  # the update did run


def test_each_rank_holds_a_quarter_of_the_experts(shards):
    """Under dp_shard=2 × tp=2 every rank holds 1/4 of the expert elements however the 4 ways are
    split between EP and FSDP (ep=4: 2 whole experts, nothing left for FSDP; ep=2: FSDP halves the 4
    experts of the rank's ep shard; ep=1: FSDP halves tp's 4 experts), and EP leaves the other
    parameters' shards alone."""
    for result in shards:
        for name in LAYOUTS:
            held, total = result[name]["expert"]
            assert held * WORLD == total, name
        assert result["ep4"]["expert_mesh"] == [["dp_shard_mod_ep", "ep"], [1, 4]]
        assert result["ep2"]["expert_mesh"] == [["dp_shard_mod_ep", "ep"], [2, 2]]
        assert result["ep1"]["expert_mesh"] == [["dp_shard", "tp"], [2, 2]]
        assert result["ep4"]["other"] == result["ep1"]["other"] == result["ep2"]["other"]
