"""Every DeviceMesh of a run, built in one place from the run plan's degrees.

World mesh dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``.
Data-parallel ranks (the ones that read different data) are ``dp_replicate × dp_shard``; the
context-parallel ranks of one data-parallel group read the same rows and split each sequence, so the
ranks whose tokens differ are ``dp × cp`` (``dp_cp``: loss, token counts, expert loads), and FSDP shards
over ``dp_shard × cp`` together (``dp_shard_cp``), as torchtitan does. Expert parallelism borrows its
ranks from inside ``dp_shard`` and, with context or tensor parallelism, every ``cp`` and ``tp`` rank too
(``seektrain.plan.layout_checks.ep_layout_error``).

Every view is kept here as it is made, so nothing slices a flattened dimension from the root mesh later
(torch 2.11 warns that this will be deprecated) and every parallel function receives exactly the mesh
it works on. The meshes need process groups, so only workers build them; the run plan stays a pure
value that the launcher and the planner resolve anywhere, and each worker hands its ``Meshes`` to what
needs them (``parallelize_model``, the step's context, the evaluator), as torchtitan's
``ParallelDims`` travels beside its job config.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Meshes:
    world: DeviceMesh
    pp: DeviceMesh
    tp: DeviceMesh
    dp: DeviceMesh  # every data-parallel rank, flattened: which rows of data a rank reads
    dp_replicate: DeviceMesh
    fsdp: DeviceMesh  # FSDP over dp_shard (× cp); HSDP over (dp_replicate, dp_shard (× cp))
    cp: DeviceMesh  # the context-parallel ranks that split one sequence (the ring of attention)
    dp_cp: DeviceMesh  # every rank whose tokens differ (dp × cp): loss and expert-load reductions
    grad_replicate: DeviceMesh  # DDP's (replicate mode's) gradient average: dp_replicate (× cp)
    ep: DeviceMesh | None = None  # ranks that split the routed experts (ep > 1 only)
    efsdp: DeviceMesh | None = None  # data-parallel ranks left over, which FSDP-shard each expert shard

    @property
    def dp_rank(self) -> int:
        """Which rows of data this rank reads (the loaders' rank among the data-parallel ones)."""
        return self.dp.get_local_rank()

    @property
    def cp_rank(self) -> int:
        """Which chunks of each sequence this rank trains (``context_parallel.local_batch``)."""
        return self.cp.get_local_rank()

    @property
    def pp_rank(self) -> int:
        """Which pipeline stages this rank runs (``pipeline.rank_stages``)."""
        return self.pp.get_local_rank()


def build_meshes(plan) -> Meshes:
    """All meshes of ``plan`` (a ``RunPlan``, or anything with its degrees and ``device_type``). Each
    call creates process groups, so every rank makes the same calls in the same order: the trainer makes
    one, right after resolving the plan, and passes the result on."""
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    shape = (plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp)
    world = init_device_mesh(plan.device_type, shape, mesh_dim_names=names)
    dp = world["dp_replicate", "dp_shard"]._flatten("dp")
    if plan.cp > 1:
        dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        shard = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        fsdp = world["dp_replicate", "dp_shard_cp"] if plan.dp_replicate > 1 else shard
        grad_replicate = dp_cp  # data_parallel=ddp has dp_shard = 1
    else:
        dp_cp, grad_replicate = dp, world["dp_replicate"]
        fsdp = world["dp_replicate", "dp_shard"] if plan.dp_replicate > 1 else world["dp_shard"]
    ep = efsdp = None
    if plan.ep > 1:
        ep, efsdp = _expert_meshes(world, plan.ep, plan.dp_shard, plan.tp, plan.dp_replicate, plan.cp)
    return Meshes(
        world,
        world["pp"],
        world["tp"],
        dp,
        world["dp_replicate"],
        fsdp,
        world["cp"],
        dp_cp,
        grad_replicate,
        ep,
        efsdp,
    )


def _expert_meshes(
    world: DeviceMesh, ep: int, dp_shard: int, tp: int, dp_replicate: int, cp: int = 1
) -> tuple[DeviceMesh, DeviceMesh]:
    """Split ``dp_shard`` into ``(dp_shard_mod_ep, dp_shard_in_ep)`` and join ``dp_shard_in_ep`` with ``cp``
    and ``tp`` into the 1-D ``ep`` mesh (innermost dimensions, so an expert exchange stays among
    neighbouring ranks). The expert-FSDP mesh is what is left of the data-parallel ranks:
    ``dp_shard_mod_ep``, 2-D with ``dp_replicate`` for HSDP. Both views share the world mesh's root, as
    FSDP requires."""
    in_ep = ep // (tp * cp)
    if cp > 1:
        split = world._unflatten(
            "dp_shard", (dp_shard // in_ep, in_ep), ("dp_shard_mod_ep", "dp_shard_in_ep")
        )
        dims = ("dp_shard_in_ep", "cp", "tp") if tp > 1 else ("dp_shard_in_ep", "cp")
        ep_mesh = split[dims]._flatten("ep")
    elif tp == 1:
        split = world._unflatten("dp_shard", (dp_shard // in_ep, in_ep), ("dp_shard_mod_ep", "ep"))
        ep_mesh = split["ep"]
    else:
        split = world._unflatten(
            "dp_shard", (dp_shard // in_ep, in_ep), ("dp_shard_mod_ep", "dp_shard_in_ep")
        )
        ep_mesh = split["dp_shard_in_ep", "tp"]._flatten("ep")
    efsdp = split["dp_replicate", "dp_shard_mod_ep"] if dp_replicate > 1 else split["dp_shard_mod_ep"]
    return ep_mesh, efsdp
