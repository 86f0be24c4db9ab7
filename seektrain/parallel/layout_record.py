"""What layout a rank actually trains, read from the parallelised objects themselves (the wrappers, the
experts' modules, the parameters' DTensor meshes and placements), never from the config.

A layout that silently falls back (expert parallelism not applied, HSDP running as plain FSDP, a
tensor-parallel plan that sharded nothing) trains the same numbers closely enough to pass a loss
comparison; it cannot hide here. The trainer writes this record into ``summary.json``
(``layout_ran``) and every layout test compares it with the layout it asked for
(tests/compare_runs.py).

Keys: ``mesh`` (world mesh dimension -> size), ``data_parallel`` (``none``, ``fsdp``, ``hsdp``, ``ddp``,
or ``replicate``: FSDP2's replicate mode under tensor parallelism), ``fsdp_units``,
``shard_group_size`` / ``replicate_group_size`` (the data-parallel ranks a non-expert parameter is
sharded / replicated over), ``tp`` (size of the ``tp`` mesh dimension parameters are sharded on, 1 if
none) and ``tp_sharded_params``, ``ep``, ``experts_per_rank`` (experts each rank computes; absent for a dense
model), ``moe_layers`` and ``ep_layers`` (MoE layers on this rank, and how many are expert-parallel),
``pp_stages`` (this rank's pipeline stages) and ``pp_schedule`` (the schedule's class), ``cp`` (the ring
size of the context-parallel attention the attention modules run, 1 for the plain kernel) and
``cp_attention_layers`` (how many run it; the run monitor adds ``cp_hops_per_step``, key/value hops
of the ring, forward and backward), ``lora`` (None
for a full fine-tune; else what this rank trains: its adapter tensors, the modules and routed-expert
groups they sit on, how many tensor parallelism shards, trainable and frozen elements, whether every base parameter
is frozen, and the dtypes the base and the adapters are stored in).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from seektrain.models import GroupedExperts
from seektrain.models.lora import is_adapter, trainable_counts
from seektrain.parallel.context_parallel import cp_degree

# "dp": every data-parallel rank, flattened (FSDP over it shards over all of them); "dp_shard_cp" and
# "dp_cp": the same with the context-parallel ranks (FSDP and DDP average gradients over them too)
DATA_PARALLEL_DIMS = ("dp", "dp_shard", "dp_shard_mod_ep", "dp_replicate", "dp_shard_cp", "dp_cp")


def _shards(placement) -> bool:
    """``Shard``, or the ``_StridedShard`` FSDP places on a dimension tensor parallelism already shards
    (which torch 2.13's ``is_shard()`` does not count)."""
    return not (placement.is_replicate() or placement.is_partial())


def _data_parallel_sizes(model: nn.Module) -> tuple[int, int]:
    """(shard, replicate) sizes over the data-parallel mesh dimensions of the first non-expert DTensor
    parameter: FSDP shards it on ``dp_shard``, HSDP and replicate mode replicate it on ``dp_replicate``."""
    for name, param in model.named_parameters():
        if ".experts." in name or not isinstance(param, DTensor):
            continue
        shard = replicate = 1
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        for dim, placement in zip(names, param.placements):
            if dim in DATA_PARALLEL_DIMS:
                size = mesh.size(names.index(dim))
                if placement.is_replicate():
                    replicate *= size
                elif _shards(placement):
                    shard *= size
        return shard, replicate
    return 1, 1


def _tensor_parallel(model: nn.Module) -> tuple[int, int]:
    """(size of the ``tp`` dimension parameters are sharded on, how many such parameters)."""
    degree, count = 1, 0
    for param in model.parameters():
        if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
            continue
        mesh = param.device_mesh
        i = (mesh.mesh_dim_names or ()).index("tp")
        if _shards(param.placements[i]):
            degree, count = max(degree, mesh.size(i)), count + 1
    return degree, count


def _experts(model: nn.Module) -> dict:
    """``ep`` and ``experts_per_rank`` of the MoE layers' experts modules, ``moe_layers`` (how many this
    rank holds) and ``ep_layers`` (how many of them are expert-parallel): an expert-parallel module
    computes ``E / ep`` experts, a tensor-parallel one ``E / tp``, a plain one all ``E``. Layers that
    disagree give the smallest ``ep`` and the largest ``experts_per_rank``, so a partly applied layout
    shows."""
    eps, per_rank = [], []
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            total = module.gate_up_proj.shape[0]
            ep_mesh, tp_mesh = getattr(module, "ep_mesh", None), getattr(module, "tp_mesh", None)
            split = ep_mesh.size() if ep_mesh is not None else tp_mesh.size() if tp_mesh is not None else 1
            eps.append(ep_mesh.size() if ep_mesh is not None else 1)
            per_rank.append(total // split)
    if not eps:
        return {"ep": 1, "moe_layers": 0, "ep_layers": 0}
    return {
        "ep": min(eps),
        "experts_per_rank": max(per_rank),
        "moe_layers": len(eps),
        "ep_layers": sum(e > 1 for e in eps),
    }


def _lora(model: nn.Module) -> dict | None:
    """The adapters this rank holds (``models/lora.py``), read from the parameters themselves: a LoRA run
    whose adapters were never added, or whose base still trains, shows here."""
    adapters = [(name, p) for name, p in model.named_parameters() if is_adapter(name)]
    if not adapters:
        return None
    trainable, frozen = trainable_counts(model)
    tp_sharded = 0
    for _, p in adapters:
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            tp_sharded += "tp" in names and _shards(p.placements[names.index("tp")])
    holders = {name.rsplit(".", 1)[0] for name, _ in adapters}
    return {
        "adapters": len(adapters),
        "adapted_modules": len(holders),
        "expert_adapter_groups": sum(h.endswith(".experts") for h in holders),
        "tp_sharded_adapters": tp_sharded,
        "trainable_elements": trainable,
        "frozen_elements": frozen,
        "base_frozen": not any(
            p.requires_grad for name, p in model.named_parameters() if not is_adapter(name)
        ),
        "adapters_trainable": all(p.requires_grad for _, p in adapters),
        "base_dtypes": sorted({str(p.dtype) for n, p in model.named_parameters() if not is_adapter(n)}),
        "adapter_dtypes": sorted({str(p.dtype) for _, p in adapters}),
    }


def _data_parallel_kind(model: nn.Module, units: list[FSDPModule], replicate: int) -> str:
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if any(isinstance(u, ReplicateModule) for u in units):
        return "replicate"
    if units:
        return "hsdp" if replicate > 1 else "fsdp"
    return "none"


def layout_ran(parallel, world_mesh) -> dict:
    """The record of ``parallel`` (a ``ParallelModel``) on this rank; ``world_mesh``: the run's world
    DeviceMesh. Cheap: walks the modules and parameters once each."""
    model = parallel.model
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    shard, replicate = _data_parallel_sizes(model)
    kind = _data_parallel_kind(model, units, replicate)
    if kind == "ddp":
        replicate = model.process_group.size()
    tp, tp_params = _tensor_parallel(model)
    cp, cp_layers = cp_degree(model)
    return {
        "mesh": dict(zip(world_mesh.mesh_dim_names, world_mesh.shape)),
        "data_parallel": kind,
        "fsdp_units": len(units),
        "shard_group_size": shard,
        "replicate_group_size": replicate,
        "tp": tp,
        "tp_sharded_params": tp_params,
        **_experts(model),
        "pp_stages": list(parallel.stage_ids),
        "pp_schedule": type(parallel.schedule).__name__ if parallel.schedule is not None else None,
        "lora": _lora(model),
        "cp": cp,
        "cp_attention_layers": cp_layers,
    }
