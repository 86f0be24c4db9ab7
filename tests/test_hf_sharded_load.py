"""The rank-sharded Hugging Face load: under every layout each rank's local shards are bit-equal to
the same slice of the whole model read the plain way (``hf_folders.full_weights``), bf16 and FP8
release folders with several shards, and the layout really sharded what it claims (a test that passed
because nothing was sharded would prove nothing).

Each layout runs the trainer's own path: ``RunPlan`` from the job, ``parallelize_model(...,
hf_path=...)`` on a meta model, on spawned gloo ranks.
"""

from __future__ import annotations

import json
import os
from functools import partial

import pytest
import torch

from hf_folders import full_weights, write_release
from seektrain.models import build_model, get_preset
from spawn_ranks import spawn_ranks

FP8_BLOCK = 48  # divides none of tiny-v3's widths (128, 352, 64·2): every sharded layout cuts blocks


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    model = build_model(get_preset("tiny-v3"), seed=3)
    return {
        "bf16": write_release(model, root / "bf16", shards=3),
        "fp8": write_release(model, root / "fp8", fp8_block=FP8_BLOCK, shards=4),
    }


def _worker(rank: int, out_dir: str, folder: str, sets: tuple[str, ...]) -> None:
    from seektrain.checkpoint.local_shards import local_shards
    from seektrain.config.loader import load_config
    from seektrain.models.job_model import configured_model_config
    from seektrain.models.lora import is_adapter
    from seektrain.parallel.mesh import build_meshes
    from seektrain.parallel.parallelize import parallelize_model
    from seektrain.plan.run_plan import RunPlan
    from seektrain.train.pipeline_step import PipelineLoss
    from seektrain.train.precision import DynamicLossScaler

    job = load_config(None, [*sets, f"model.hf_path={folder}"])
    cfg = configured_model_config(job)
    plan = RunPlan.resolve(job, cfg, int(os.environ["WORLD_SIZE"]), "cpu")
    loss = PipelineLoss(DynamicLossScaler(False, 1.0, 1), job.train.mtp_loss_weight) if plan.pp > 1 else None
    meshes = build_meshes(plan)
    pm = parallelize_model(
        build_model(plan.model, device="meta"), plan, meshes, torch.device("cpu"), folder, loss
    )
    oracle = full_weights(folder, plan.model)
    rows = []
    for part in pm.parts:
        for shard in local_shards(part):
            if is_adapter(shard.name):
                continue
            want = oracle[shard.name][tuple(slice(a, b) for a, b in shard.box)].to(shard.local.dtype)
            rows.append(
                {
                    "name": shard.name,
                    "box": shard.box,
                    "full": list(shard.full_shape),
                    "dtype": str(shard.local.dtype),
                    "equal": torch.equal(shard.local.cpu(), want),
                }
            )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(rows, fh)


def _load(tmp_path, folder: str, world: int, *sets: str) -> list[list[dict]]:
    spawn_ranks(partial(_worker, folder=folder, sets=sets), world, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]
    for rank, rows in enumerate(ranks):
        wrong = [row["name"] for row in rows if not row["equal"]]
        assert not wrong, f"rank {rank}: {len(wrong)} local shards differ from the full load, e.g. {wrong[0]}"
    return ranks


def _sharded(rows: list[dict], name_part: str, dim: int) -> list[dict]:
    """The rows of tensors whose names contain ``name_part`` and whose box is a strict part of ``dim``."""
    return [
        r for r in rows if name_part in r["name"] and r["box"][dim][1] - r["box"][dim][0] < r["full"][dim]
    ]


def _owners(ranks, name: str) -> list[tuple[int, int]]:
    return sorted(tuple(row["box"][0]) for rows in ranks for row in rows if row["name"] == name)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_fsdp2(tmp_path, folders, kind):
    ranks = _load(tmp_path, folders[kind], 2, "parallel.dp_shard=2")
    assert _owners(ranks, "layers.1.self_attn.o_proj.weight") == [(0, 64), (64, 128)]  # FSDP: dim 0 halves
    assert _owners(ranks, "layers.2.mlp.experts.gate_up_proj") == [(0, 4), (4, 8)]
    assert all(r["dtype"] == "torch.float32" for r in ranks[0])


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_tp2(tmp_path, folders, kind):
    ranks = _load(tmp_path, folders[kind], 2, "parallel.tp=2", "parallel.dp_shard=1")
    both = ranks[0] + ranks[1]
    assert _sharded(both, "mlp.down_proj", 1), "no row-parallel (dim 1) shard of a dense MLP"
    assert _sharded(both, "mlp.up_proj", 0), "no column-parallel (dim 0) shard of a dense MLP"


def test_ep2_fsdp2(tmp_path, folders):
    ranks = _load(tmp_path, folders["fp8"], 2, "parallel.ep=2", "parallel.dp_shard=2")
    assert _owners(ranks, "layers.3.mlp.experts.down_proj") == [(0, 4), (4, 8)]


def test_pp2(tmp_path, folders):
    ranks = _load(
        tmp_path, folders["bf16"], 2, "parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=2"
    )
    layers = [{r["name"].split(".")[1] for r in rows if r["name"].startswith("layers.")} for rows in ranks]
    assert (
        layers[0]
        and layers[1]
        and not layers[0] & layers[1]
        and layers[0] | layers[1] == {"0", "1", "2", "3"}
    )
    assert any(r["name"].startswith("mtp.") for r in ranks[1]) and not any(
        r["name"].startswith("mtp.") for r in ranks[0]
    )


def test_fsdp2_x_tp2_x_ep2(tmp_path, folders):
    ranks = _load(tmp_path, folders["fp8"], 4, "parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=2")
    everyone = [r for rows in ranks for r in rows]
    assert _sharded(everyone, "self_attn.o_proj", 1), "no tensor-parallel shard of o_proj"
    experts = {tuple(r["box"][0]) for r in everyone if r["name"] == "layers.1.mlp.experts.gate_up_proj"}
    assert all(b - a < 8 for a, b in experts), f"an expert tensor is whole on a rank: {sorted(experts)}"
    assert set().union(*(range(a, b) for a, b in experts)) == set(range(8)), sorted(experts)


def test_fsdp3_uneven_shards(tmp_path, folders):
    """Three ranks: 128 rows shard 43 / 43 / 42 (FSDP2's uneven last shard)."""
    ranks = _load(
        tmp_path,
        folders["fp8"],
        3,
        "parallel.dp_shard=3",
        "train.micro_batch_size=1",
        "train.global_batch_size=3",
    )
    assert _owners(ranks, "layers.1.self_attn.o_proj.weight") == [(0, 43), (43, 86), (86, 128)]


def test_hsdp_2x2(tmp_path, folders):
    """HSDP: replicated over dp_replicate, sharded over dp_shard: the two replicas load the same shards."""
    ranks = _load(
        tmp_path,
        folders["bf16"],
        4,
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "train.micro_batch_size=1",
    )
    assert _owners(ranks, "layers.1.self_attn.o_proj.weight") == [(0, 64), (0, 64), (64, 128), (64, 128)]


def test_cp2(tmp_path, folders):
    """Context parallelism shards no weight (FSDP over the cp ranks does): the same shards as FSDP=2."""
    ranks = _load(tmp_path, folders["fp8"], 2, "parallel.cp=2", "parallel.dp_shard=1", "train.seq_len=128")
    assert _owners(ranks, "layers.1.self_attn.o_proj.weight") == [(0, 64), (64, 128)]


def test_fsdp2_cpu_offload(tmp_path, folders):
    """Offloaded shards live in host memory: the loader fills them there."""
    ranks = _load(tmp_path, folders["fp8"], 2, "parallel.dp_shard=2", "parallel.cpu_offload=true")
    assert _owners(ranks, "layers.1.self_attn.o_proj.weight") == [(0, 64), (64, 128)]


def test_lora_fsdp2_bf16_base(tmp_path, folders):
    ranks = _load(
        tmp_path, folders["fp8"], 2, "parallel.dp_shard=2", "lora.enabled=true", "precision.dtype=bf16"
    )
    assert {r["dtype"] for r in ranks[0]} >= {"torch.bfloat16"}, "the frozen base is not held in bf16"
