"""``parallel.cpu_offload``: FSDP2's CPUOffloadPolicy is really applied (every FSDP unit, the experts'
included), clipping works on offloaded gradients, offload without FSDP is refused in one line, and
training with offload is the same computation as without (fp32 losses, gradient norms, parameters).

On this CPU machine the offload moves nothing (host to host), but FSDP runs its offload path: shards
materialised on the host, gradients reduced into host tensors, the optimizer stepping host tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from compare_runs import assert_same_run, run_layout
from seektrain.config.loader import ConfigError, load_config
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan.run_plan import RunPlan
from spawn_ranks import spawn_ranks

CLIP = "train.grad_clip=0.05"  # below the tiny model's gradient norms, so every step is clipped


def test_offload_needs_fsdp():
    job = load_config(
        None,
        [
            "parallel.cpu_offload=true",
            "parallel.data_parallel=ddp",
            "parallel.dp_shard=1",
            "parallel.dp_replicate=2",
        ],
    )
    with pytest.raises(ConfigError, match="parallel.cpu_offload needs parallel.data_parallel=fsdp"):
        RunPlan.resolve(job, get_preset("tiny-v3"), 2, "cpu")


def test_offload_shards_even_one_rank():
    """Offloading is FSDP's: with one data-parallel rank FSDP runs over a mesh of one."""
    plan = RunPlan.resolve(load_config(None, ["parallel.cpu_offload=true"]), get_preset("tiny-v3"), 1, "cpu")
    assert plan.uses_fsdp and plan.cpu_offload and "cpu_offload" in plan.describe()
    assert not RunPlan.resolve(load_config(None, []), get_preset("tiny-v3"), 1, "cpu").uses_fsdp


def _worker(rank: int, out_dir: str) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from seektrain.models import build_model
    from seektrain.parallel.mesh import build_meshes
    from seektrain.parallel.parallelize import parallelize_model
    from seektrain.train.grad import clip_grad_norm
    from seektrain.train.loss import model_loss

    job = load_config(None, ["parallel.cpu_offload=true", "parallel.ep=2", "precision.dtype=fp32"])
    plan = RunPlan.resolve(job, get_preset("tiny-v3"), 2, "cpu")
    meshes = build_meshes(plan)
    model = parallelize_model(build_model(plan.model, device="meta"), plan, meshes, torch.device("cpu")).model
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = [
        type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
        for m in units
        if m._get_fsdp_state()._fsdp_param_group is not None
    ]
    expert_units = sum(".experts" in name for name, m in model.named_modules() if isinstance(m, FSDPModule))
    tokens = torch.randint(0, plan.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    loss, _ = model_loss(model(tokens, mtp_tokens=tokens), tokens, 0.3)
    loss.backward()
    grads_on_host = all(
        p.grad.to_local().device.type == "cpu" for p in model.parameters() if p.grad is not None
    )
    before = clip_grad_norm(list(model.parameters()), max_norm=0.01)
    after = clip_grad_norm(list(model.parameters()), max_norm=0)
    result = {
        "policies": policies,
        "expert_units": expert_units,
        "grads_on_host": grads_on_host,
        "before": before.item(),
        "after": after.item(),
        "cpu_policy": CPUOffloadPolicy.__name__,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_policy_applied_and_clipping_on_host_gradients(tmp_path):
    spawn_ranks(_worker, 2, str(tmp_path))
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["policies"] and set(got["policies"]) == {"CPUOffloadPolicy"}
        assert got["expert_units"] > 0  # shard_experts got the policy too (it is in the set above)
        assert got["grads_on_host"]
        assert got["before"] > 0.01
        assert got["after"] == pytest.approx(0.01, rel=1e-4)


def test_offload_trains_like_no_offload(tmp_path):
    """FSDP=2, 5 fp32 steps with clipping: equal losses, gradient norms and parameters."""
    want = run_layout(tmp_path / "plain", "tiny-v3", 2, CLIP)
    got = run_layout(tmp_path / "offload", "tiny-v3", 2, CLIP, "parallel.cpu_offload=true")
    assert "cpu_offload" in (got.dir / "train.log").read_text()  # the layout line names it
    assert_same_run(got, want)


def test_one_rank_offload_trains_like_one_process(tmp_path, one_process_run):
    """One process with offload (FSDP over a mesh of one) against the plain single-process model."""
    got = run_layout(tmp_path, "tiny-v3", 1, "parallel.cpu_offload=true")
    assert "cpu_offload" in (got.dir / "train.log").read_text()
    assert_same_run(got, one_process_run("tiny-v3"))
