"""Turn a model config into the parallelised, initialised model parts of this rank (torchtitan's
recipe): build on the meta device, cut out this rank's pipeline stages, apply expert and tensor
parallelism (experts first: the tensor-parallel plan of an MoE block depends on whether its experts are
already expert-parallel), activation checkpointing and FSDP/HSDP, materialise only this rank's shards, then
initialise them. DDP wraps the initialised model last, because it needs real tensors; a tensor-parallel
model takes FSDP2's replicate mode instead, applied like FSDP (``_replicate_tensor_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.models.transformer import Transformer, build_model
from seektrain.parallel.activation_checkpoint import apply_activation_checkpointing
from seektrain.parallel.data_parallel import apply_ddp, apply_fsdp, fsdp_mixed_precision
from seektrain.parallel.layout import ParallelLayout


@dataclass
class ParallelModel:
    """What one rank trains. ``model`` is a single module with the whole model's parameter names for
    the parts this rank holds (optimizer, checkpoints and clipping use it); ``parts`` are the pipeline
    stages run by ``schedule`` (one part and no schedule without pipeline parallelism)."""

    model: nn.Module
    parts: list[nn.Module]
    stage_ids: list[int]
    schedule: object | None = None

    @property
    def has_last_stage(self) -> bool:
        return self.schedule is None or any(p.norm is not None for p in self.parts)


def dp_mesh_for(layout: ParallelLayout, mesh: DeviceMesh) -> DeviceMesh:
    """FSDP over dp_shard, HSDP over (dp_replicate, dp_shard), DDP over all data-parallel ranks."""
    if layout.data_parallel == "fsdp":
        return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    return mesh["dp"]


def uses_fsdp(layout: ParallelLayout) -> bool:
    """FSDP only where there is something to shard over; one data-parallel rank trains the plain model."""
    return layout.data_parallel == "fsdp" and layout.dp > 1


def _parallelize_part(part: Transformer, job: JobConfig, layout: ParallelLayout, mesh: DeviceMesh,
                      ep_meshes) -> None:
    if ep_meshes is not None:
        from seektrain.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(part, ep_meshes.ep, ep_meshes.tp)
    if layout.tp > 1:
        from seektrain.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(part, mesh["tp"], sequence_parallel=True)
    apply_activation_checkpointing(part, job.train.activation_checkpoint)
    if uses_fsdp(layout):
        # Under pipelining, parameters stay gathered across the micro-batches of one step.
        reshard = job.parallel.reshard_after_forward and layout.pp == 1
        mp = fsdp_mixed_precision(job.precision.dtype, job.precision.reduce_dtype)
        if ep_meshes is not None:  # experts first, on their own mesh; the per-layer FSDP then skips them
            from seektrain.parallel.expert_parallel import shard_experts

            shard_experts(part, ep_meshes.efsdp, mp, reshard)
        apply_fsdp(part, dp_mesh_for(layout, mesh), mp, reshard)
    elif layout.tp > 1 and layout.dp > 1:  # data_parallel=ddp
        _replicate_tensor_parallel(part, mesh["dp_replicate"])


def _replicate_tensor_parallel(part: Transformer, dp_mesh: DeviceMesh) -> None:
    """DDP for a tensor-parallel model. ``DistributedDataParallel`` cannot take DTensor parameters (its
    start-up broadcast has no DTensor rule), so FSDP2's replicate mode does the same job: no sharding,
    gradients averaged over ``dp_mesh`` per block during backward (like DDP's buckets), parameters
    DTensors on the ``(dp_replicate, tp)`` mesh, so clipping and checkpoints work as under FSDP. Mixed
    precision stays autocast's, as with DDP."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in list(part.layers.values()) + list(getattr(part, "mtp", None) or []):
        replicate(block, mesh=dp_mesh)
    replicate(part, mesh=dp_mesh)


def parallelize_model(model_cfg: ModelConfig, job: JobConfig, layout: ParallelLayout, mesh: DeviceMesh,
                      device: torch.device, state_dict: dict | None = None, loss_fn=None,
                      n_microbatches: int = 1) -> ParallelModel:
    """The parts of the model this rank trains. ``state_dict`` (full tensors, e.g. from Hugging Face)
    replaces random init; ``loss_fn(output, labels)`` and ``n_microbatches`` feed the pipeline schedule."""
    whole: Transformer = build_model(model_cfg, device="meta")
    ep_meshes = None
    if layout.ep > 1:
        from seektrain.parallel.expert_parallel import build_ep_meshes, validate_ep

        validate_ep(model_cfg, layout.ep, layout.dp_shard, layout.tp)
        ep_meshes = build_ep_meshes(mesh, layout.ep)
    if layout.tp > 1:
        from seektrain.parallel.tensor_parallel import validate_tp

        validate_tp(model_cfg, layout.tp)
    if layout.pp == 1:
        parts, ids = [whole], [0]
    else:
        from seektrain.parallel import pipeline

        per_rank = pipeline.stages_per_rank(job.parallel.pp_schedule, job.parallel.pp_stages_per_rank)
        n_stages = layout.pp * per_rank
        bounds = pipeline.split_layers(model_cfg, n_stages, job.parallel.pp_split or None)
        ids = pipeline.stage_ids(mesh["pp"].get_local_rank(), layout.pp, per_rank, job.parallel.pp_schedule)
        parts = [pipeline.build_stage_model(whole, bounds[i], i == 0, i == n_stages - 1) for i in ids]
    for part in parts:
        _parallelize_part(part, job, layout, mesh, ep_meshes)
        part.to_empty(device=device)
        if state_dict is None:
            part.init_weights(job.train.seed)
        else:
            load_full_state_dict(part, state_dict)
    if not uses_fsdp(layout) and layout.dp > 1 and layout.tp == 1:
        if layout.pp > 1:
            raise ValueError("pipeline parallelism composes with parallel.data_parallel=fsdp; set it")
        parts = [apply_ddp(parts[0], dp_mesh_for(layout, mesh))]
    if layout.pp == 1:
        return ParallelModel(parts[0], parts, ids)
    schedule = pipeline.build_schedule(parts, ids, n_stages, device, mesh["pp"].get_group(),
                                       job.parallel.pp_schedule, n_microbatches, loss_fn, world_mesh=mesh)
    return ParallelModel(_merged_view(parts), parts, ids, schedule)


class _PartsView(nn.Module):
    """Holds (does not copy) several pipeline parts' submodules under the whole model's names."""

    def __init__(self, parts: list[Transformer]):
        super().__init__()
        self.embed_tokens = self.norm = self.lm_head = self.mtp = None
        self.layers = nn.ModuleDict()
        for part in sorted(parts, key=lambda p: min((int(k) for k in p.layers.keys()), default=0)):
            for key, layer in part.layers.items():
                self.layers[key] = layer
            for name in ("embed_tokens", "norm", "lm_head", "mtp"):
                if getattr(part, name) is not None:
                    setattr(self, name, getattr(part, name))


def _merged_view(parts: list[Transformer]) -> nn.Module:
    return parts[0] if len(parts) == 1 else _PartsView(parts)


def load_full_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Copy full (unsharded) tensors into a possibly sharded model part; each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    wanted = set(model.state_dict().keys())
    subset = {k: v for k, v in state_dict.items() if k in wanted}
    set_model_state_dict(model, subset, options=StateDictOptions(full_state_dict=True, strict=True))


def unwrap(model: nn.Module) -> Transformer:
    """The Transformer inside DDP (FSDP2 and checkpoint wrappers keep the module itself)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, Transformer) else model
