"""Expert parallelism is the same computation as one process (fp32, gloo, 2 ranks, ep=2).

Two spawned ranks each train on their half of every global batch; one process trains the plain model
on the whole batch. Losses, every (gathered) gradient, the trained weights and the V3 balancing biases
must agree, with plain data parallelism (non-expert gradients averaged by hand) and with FSDP.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from compare_runs import FP32
from seektrain.config.schema import OptimSection
from seektrain.models import build_model
from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.moe import GroupedExperts
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan.layout_checks import check_model
from spawn_ranks import spawn_ranks
from tolerances import model_rel, model_tol

PRESETS = ("tiny-v2", "tiny-v3")
WORLD, ROWS_PER_RANK, SEQ, STEPS = 2, 2, 32, 5
AUX_ALPHA, MTP_WEIGHT, BIAS_SPEED = 1e-2, 0.3, 1e-3
OPTIM = OptimSection(lr=3e-3, warmup_steps=0, weight_decay=0.1)


def _batches(cfg: ModelConfig):
    gen = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        shape = (WORLD * ROWS_PER_RANK, SEQ)
        tokens = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        yield tokens, torch.randint(0, cfg.vocab_size, shape, generator=gen)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model, cfg: ModelConfig, rows: slice, steps: int, group=None, sync_grads=None) -> dict:
    """``steps`` AdamW steps, each followed by the balancing-bias update (0: one backward, gradients only)."""
    from seektrain.train.balance import (
        collect_expert_load,
        configure_aux_loss,
        moe_layers,
        update_balance_bias,
    )
    from seektrain.train.loss import model_loss
    from seektrain.train.optim import build_optimizer

    configure_aux_loss(model, AUX_ALPHA, 1.0)
    opt = build_optimizer(model, OPTIM) if steps else None
    losses, grads = [], None
    for step, (tokens, labels) in enumerate(_batches(cfg)):
        tokens, labels = tokens[rows], labels[rows]
        out = model(tokens, mtp_tokens=tokens if cfg.num_nextn_predict_layers else None)
        loss, _ = model_loss(out, labels, MTP_WEIGHT)
        loss.backward()
        if sync_grads:
            sync_grads(model)
        loss = loss.detach()
        if group is not None:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        losses.append(float(loss))
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        if not steps:
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_balance_bias(model, collect_expert_load(model, group), BIAS_SPEED)
    biases = [
        m.gate.e_score_correction_bias.clone()
        for m in moe_layers(model)
        if m.gate.e_score_correction_bias is not None
    ]
    return {"losses": losses, "grads": grads, "biases": biases}


# ------------------------------------------------------------------------------------------ ranks
def _average_plain_grads(model) -> None:
    """Plain data parallelism by hand: average what DDP would; expert (DTensor) gradients stay as they are."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if p.grad is not None and not isinstance(p.grad, DTensor):
            dist.all_reduce(p.grad)
            p.grad /= WORLD


def _ep_model(cfg, meshes, fsdp_mesh=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from seektrain.parallel.data_parallel import apply_fsdp, fsdp_mixed_precision
    from seektrain.parallel.expert_parallel import apply_expert_parallel, shard_experts

    model = build_model(cfg, device="meta")
    apply_expert_parallel(model, meshes.ep)
    if fsdp_mesh is not None:
        shard_experts(model, meshes.efsdp, MixedPrecisionPolicy(), reshard_after_forward=True)
        apply_fsdp(model, fsdp_mesh, fsdp_mixed_precision("fp32"), reshard_after_forward=True)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def _empty_experts_case(meshes, rank: int) -> dict:
    """Every token goes to experts 0..3, so rank 1's experts receive nothing."""
    from seektrain.parallel.expert_parallel import ExpertParallelExperts

    torch.manual_seed(0)
    plain = GroupedExperts(8, 16, 8)
    with torch.no_grad():
        plain.gate_up_proj.normal_()
        plain.down_proj.normal_()
    ep = ExpertParallelExperts(plain, meshes.ep)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    counts = torch.tensor([2, 1, 3, 0, 0, 0, 0, 0])
    y_ep, y_plain = ep.run_sorted(x, counts), plain.run_sorted(x, counts)
    y_ep.pow(2).sum().backward()
    y_plain.pow(2).sum().backward()
    for p in plain.parameters():
        dist.all_reduce(p.grad)
        p.grad /= WORLD

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    grads = zip(ep.parameters(), plain.parameters())
    return {
        "out": rel(y_ep, y_plain),
        "grad": max(rel(_full(e.grad), p.grad) for e, p in grads),
        "idle": float(ep.gate_up_proj.grad.to_local().abs().sum()) if rank else None,
    }


def _worker(rank: int, out_dir: str) -> None:
    from types import SimpleNamespace

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from seektrain.parallel.mesh import build_meshes

    meshes = build_meshes(
        SimpleNamespace(device_type="cpu", pp=1, dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, ep=WORLD)
    )
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    results = {"empty": _empty_experts_case(meshes, rank)}
    for name in PRESETS:
        cfg = get_preset(name)
        results[name, "dp"] = _train(
            _ep_model(cfg, meshes), cfg, rows, 0, dist.group.WORLD, _average_plain_grads
        )
        model = _ep_model(cfg, meshes, fsdp_mesh=meshes.fsdp)
        expert = [p for n, p in model.named_parameters() if ".experts." in n]
        results[name, "expert_numel"] = (
            sum(p.to_local().numel() for p in expert),
            sum(p.numel() for p in expert),
        )
        results[name, "fsdp"] = _train(model, cfg, rows, STEPS, dist.group.WORLD)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        results[name, "state"] = state if rank == 0 else None
    if rank:
        for key in list(
            results
        ):  # only rank 0's gradients and weights are compared: keep rank 1's file small
            if isinstance(results[key], dict) and "grads" in results[key]:
                results[key]["grads"] = None
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep")
    spawn_ranks(_worker, WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference() -> dict:
    """The plain model on the whole batch, in this process."""
    results = {}
    for name in PRESETS:
        cfg = get_preset(name)
        results[name, "grads"] = _train(build_model(cfg, seed=0), cfg, slice(None), 0)
        model = build_model(cfg, seed=0)
        results[name] = _train(model, cfg, slice(None), STEPS)
        results[name, "state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return results


# ------------------------------------------------------------------------------------------ tests
def _assert_grads_match(got: dict, want: dict, cfg: ModelConfig) -> None:
    """Expert-sharded grouped products and the averaged data-parallel gradients sum the same terms in
    another order: each gradient within the model chain's rounding of its own scale."""
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert got[name].shape == grad.shape, name
        tol = model_tol(cfg, SEQ, grad.abs().max(), backward=True)
        torch.testing.assert_close(got[name], grad, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_first_step_loss_and_gradients_match_one_process(ranks, reference, preset, mode):
    want = reference[preset, "grads"]
    got = ranks[0][preset, mode]
    cfg = get_preset(preset)
    assert got["losses"][0] == pytest.approx(want["losses"][0], rel=model_rel(cfg, SEQ))
    assert ranks[1][preset, mode]["losses"][0] == got["losses"][0]
    _assert_grads_match(got["grads"], want["grads"], cfg)


@pytest.mark.parametrize("preset", PRESETS)
def test_training_with_fsdp_matches_one_process(ranks, reference, preset):
    """5 AdamW steps with the balancing-bias update: same losses, same weights, identical biases."""
    want = reference[preset]
    for r in range(WORLD):
        got = ranks[r][preset, "fsdp"]["losses"]  # step 1 on equal weights; then the AdamW trajectory
        assert got[0] == pytest.approx(want["losses"][0], rel=model_rel(get_preset(preset), SEQ))
        assert got[1:] == pytest.approx(want["losses"][1:], rel=FP32.loss_rel, abs=FP32.loss_abs)
    got0, got1 = ranks[0][preset, "fsdp"]["biases"], ranks[1][preset, "fsdp"]["biases"]
    assert len(got0) == len(want["biases"]) == (4 if preset == "tiny-v3" else 0)
    for b0, b1, ref in zip(got0, got1, want["biases"]):
        assert torch.equal(b0, b1)
        torch.testing.assert_close(b0, ref, rtol=0, atol=1e-6)
    if got0:
        assert any(b.abs().sum() > 0 for b in got0)  # the update did run
    state, ref_state = ranks[0][preset, "state"], reference[preset, "state"]
    assert state.keys() == ref_state.keys()  # DCP / full state dicts keep the single-process names
    for key, value in ref_state.items():
        # Adam turns last-bit gradient differences on near-zero gradients into up to ~lr-sized steps on
        # single elements; gradient scaling errors (to which Adam is blind) are caught by the test above.
        assert state[key].shape == value.shape, key
        torch.testing.assert_close(
            state[key], value, rtol=0, atol=OPTIM.lr / 6, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.parametrize("preset", PRESETS)
def test_each_rank_holds_half_of_the_experts(ranks, preset):
    for r in range(WORLD):
        local, total = ranks[r][preset, "expert_numel"]
        assert local * WORLD == total


def test_rank_without_tokens_for_its_experts(ranks):
    for r in range(WORLD):
        assert ranks[r]["empty"]["out"] < 1e-6
        assert ranks[r]["empty"]["grad"] < 1e-6
    assert ranks[1]["empty"]["idle"] == 0.0  # rank 1's experts saw no token: a zero gradient, not None


@pytest.mark.parametrize(
    "cfg_changes, ep, dp_shard, tp, message",
    [
        ({}, 3, 6, 1, r"^parallel\.ep=3 does not divide the 8 routed experts"),
        ({}, 4, 2, 1, r"^parallel\.ep=4 must divide parallel\.dp_shard=2"),
        ({}, 3, 3, 2, r"^parallel\.ep=3 must be a multiple of parallel\.tp=2"),
        ({}, 8, 2, 2, r"^parallel\.ep=8 must divide parallel\.dp_shard × tp = 2×2 = 4"),
        (
            {"n_routed_experts": 12, "n_group": 1, "topk_group": 1},
            8,
            4,
            2,
            r"^parallel\.ep=8 does not divide the 12",
        ),
        ({"n_routed_experts": 0}, 2, 2, 1, r"^parallel\.ep=2 needs a MoE model"),
        ({}, 0, 2, 1, r"^parallel\.ep=0 must be >= 1"),
    ],
)
def test_plan_rejects_ep_that_does_not_fit(cfg_changes, ep, dp_shard, tp, message):
    cfg = get_preset("tiny-v3").replace(**cfg_changes)
    with pytest.raises(ValueError, match=message) as err:
        check_model(cfg, tp=tp, ep=ep, dp_shard=dp_shard)
    assert "\n" not in str(err.value)


def test_plan_accepts_ep_that_fits():
    check_model(get_preset("tiny-v3"), tp=1, ep=2, dp_shard=4)
    check_model(get_preset("tiny-dense"), tp=2, ep=1, dp_shard=4)
    check_model(get_preset("tiny-v3"), tp=2, ep=2, dp_shard=1)  # ep over the two tp ranks
    check_model(get_preset("tiny-v3"), tp=2, ep=4, dp_shard=2)  # ep over both tp groups
    check_model(get_preset("tiny-v3"), tp=2, ep=2, dp_shard=2)  # ep = one tp group; FSDP over dp_shard
