"""Tensor (+ sequence) parallelism computes what one process computes: on 2 gloo ranks, every layer type
(GQA, MLA with and without a query latent, softmax and sigmoid MoE with shared experts, MTP) gives the
same initial weights, loss and gradients as the plain model, and the same losses over AdamW steps."""

from __future__ import annotations

import json
import os

import pytest
import torch

from seektrain.config.schema import OptimSection
from seektrain.models import build_model, get_preset
from seektrain.plan.layout_checks import check_model
from spawn_ranks import spawn_ranks
from tolerances import model_rel, model_tol

WORLD = 2
STEPS = 5
# torch's clip coefficient is max_norm / (norm + 1e-6): short of 0.5 by 1e-6 / norm < 2e-6 (norm > 0.5),
# plus the rounding of the scaled gradients' squares summed in fp64 (~1e-7)
CLIP_REL = 3e-6
# (preset, sequence parallel)
CASES = [("tiny-dense", True), ("tiny-v2", True), ("tiny-v3", True), ("tiny-v3", False)]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(cfg, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    loss_labels = labels.clone()
    loss_labels[0, :3] = -100  # exercise ignore_index under loss_parallel
    return tokens, labels, loss_labels


def _step(model, tokens, labels, loss_labels, tp: bool) -> float:
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    from seektrain.train.loss import model_loss

    with loss_parallel() if tp else contextlib.nullcontext():
        out = model(tokens, mtp_tokens=tokens if model.cfg.num_nextn_predict_layers else None)
        loss, _ = model_loss(out, loss_labels, 0.3)
        loss.backward()
    return float(loss)


def _train(model, tp: bool) -> tuple[list[float], list[float]]:
    from seektrain.train.balance import collect_expert_load, update_balance_bias
    from seektrain.train.grad import clip_grad_norm
    from seektrain.train.optim import build_optimizer

    opt = build_optimizer(model, OptimSection(lr=3e-3))
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(_step(model, *_batch(model.cfg, 100 + step), tp))
        # measure only: clipping is compared once, directly on the gradients, in _case (a clipped
        # trajectory lets a last-bit difference flip a near-tied expert choice of tiny-v3 by step 3)
        norms.append(float(clip_grad_norm([p for p in model.parameters() if p.grad is not None], 0.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_balance_bias(model, collect_expert_load(model, None), 1e-2)
    return losses, norms


def _case(preset: str, sp: bool, mesh) -> dict:
    from seektrain.parallel.tensor_parallel import apply_tensor_parallel
    from seektrain.train.balance import configure_aux_loss

    cfg = get_preset(preset)
    ref = build_model(cfg, seed=3)
    model = build_model(cfg, device="meta")
    apply_tensor_parallel(model, mesh, sequence_parallel=sp)
    model.to_empty(device="cpu")
    model.init_weights(3)
    for m in (ref, model):
        configure_aux_loss(m, alpha=0.01, grad_scale=1.0)  # the sequence-wise balance loss reaches the router
    ref_params = dict(ref.named_parameters())
    result = {
        "init_diff": max(float((_full(p) - ref_params[n]).abs().max()) for n, p in model.named_parameters()),
        "names_equal": sorted(ref.state_dict()) == sorted(model.state_dict()),
        "local_numel": sum(p.to_local().numel() for p in model.parameters()),
        "total_numel": sum(p.numel() for p in ref.parameters()),
    }

    batch = _batch(cfg, 7)
    ref_loss, tp_loss = _step(ref, *batch, tp=False), _step(model, *batch, tp=True)
    result["loss_diff"] = abs(ref_loss - tp_loss) / abs(ref_loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    result["grad_diff"] = max(  # relative to each gradient's scale
        float((_full(grads[n]) - p.grad).abs().max() / p.grad.abs().max()) for n, p in ref_params.items()
    )
    result["missing_grads"] = [n for n, g in grads.items() if g is None]
    from seektrain.train.grad import clip_grad_norm

    norms = [
        float(clip_grad_norm([p for p in m.parameters() if p.grad is not None], 0.5)) for m in (ref, model)
    ]
    result["norm_diff"] = abs(norms[0] - norms[1]) / norms[0]
    result["clipped_grad_diff"] = max(
        float((_full(grads[n]) - p.grad).abs().max()) for n, p in ref_params.items()
    )
    result["clipped_norm"] = float(
        torch.cat([p.grad.flatten().double() for p in ref.parameters() if p.grad is not None]).norm()
    )
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)

    result["ref_losses"], result["ref_norms"] = _train(ref, tp=False)
    result["tp_losses"], result["tp_norms"] = _train(model, tp=True)
    biases = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    ref_buffers = dict(ref.named_buffers())
    result["bias_diff"] = max([float((b - ref_buffers[n]).abs().max()) for n, b in biases], default=0.0)
    result["bias_sum"] = sum(float(b.abs().sum()) for _, b in biases)
    return result


def _worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    results = {f"{p}-sp{int(sp)}": _case(p, sp, mesh) for p, sp in CASES}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    spawn_ranks(_worker, WORLD, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("preset,sp", CASES)
def test_tp_matches_single_process(results, preset, sp):
    for rank_results in results:
        r = rank_results[f"{preset}-sp{int(sp)}"]
        assert r["names_equal"]
        assert r["init_diff"] == 0.0  # layout-independent init: the same weights, bit for bit
        assert r["missing_grads"] == []
        cfg = get_preset(preset)  # sharded matmuls sum the same products in another order
        assert r["loss_diff"] <= model_rel(cfg, 16)
        assert r["grad_diff"] <= model_tol(cfg, 16, 1.0, backward=True)["atol"]
        # clipping scales the DTensor gradients exactly as the plain ones (norm > 0.5, so it did clip)
        assert r["norm_diff"] < 1e-6 and r["clipped_norm"] == pytest.approx(0.5, rel=CLIP_REL)
        assert r["clipped_grad_diff"] < 1e-6
        # AdamW's first steps amplify the last-bit differences of reordered sums a little: 2.24e-5 relative
        # at step 4 on an AVX2-only AMD EPYC (8-lane sums), where 2e-5 had held on AVX-512 machines.
        assert r["tp_losses"] == pytest.approx(r["ref_losses"], rel=5e-5, abs=5e-5)
        # the grad norms follow those losses: 2.17e-3 relative on the AVX2-only EPYC (2e-3 held on AVX-512)
        assert r["tp_norms"] == pytest.approx(r["ref_norms"], rel=5e-3)
        assert r["bias_diff"] < 1e-6  # every tp rank routes the same tokens: same balancing bias
    if preset == "tiny-v3":
        assert results[0][f"{preset}-sp{int(sp)}"]["bias_sum"] > 0  # the bias update did run


def test_tp_shards_parameters(results):
    r = results[0]["tiny-dense-sp1"]
    assert r["local_numel"] < 0.6 * r["total_numel"]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 96}, "num_attention_heads=3"),
        ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
        ({"vocab_size": 321}, "vocab_size=321"),
        ({"intermediate_size": 353}, "intermediate_size=353"),
    ],
)
def test_plan_rejects_tp_that_does_not_divide_dense(change, message):
    cfg = get_preset("tiny-dense").replace(**change)
    with pytest.raises(ValueError, match=message) as err:
        check_model(cfg, tp=2, ep=1, dp_shard=1)
    assert "\n" not in str(err.value)


def test_plan_rejects_tp_that_does_not_divide_moe():
    with pytest.raises(ValueError, match="n_routed_experts=9"):
        check_model(
            get_preset("tiny-v3").replace(n_routed_experts=9, n_group=1, topk_group=1), tp=2, ep=1, dp_shard=1
        )
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_model(get_preset("tiny-v3").replace(moe_intermediate_size=63), tp=2, ep=1, dp_shard=1)
    check_model(get_preset("tiny-v3"), tp=2, ep=1, dp_shard=1)
    check_model(get_preset("deepseek-v3"), tp=8, ep=1, dp_shard=1)
