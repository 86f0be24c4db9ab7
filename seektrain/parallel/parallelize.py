"""Turn a model config into a parallelised, initialised model on this rank (torchtitan's recipe):
build on the meta device, apply activation checkpointing and FSDP/HSDP, materialise only this rank's
shards, then initialise them. DDP wraps the initialised model last, because it needs real tensors."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.models.transformer import Transformer, build_model
from seektrain.parallel.activation_checkpoint import apply_activation_checkpointing
from seektrain.parallel.data_parallel import apply_ddp, apply_fsdp
from seektrain.parallel.layout import ParallelLayout


def dp_mesh_for(layout: ParallelLayout, mesh: DeviceMesh) -> DeviceMesh:
    """FSDP over dp_shard, HSDP over (dp_replicate, dp_shard), DDP over all data-parallel ranks."""
    if layout.data_parallel == "fsdp":
        return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    return mesh["dp"]


def uses_fsdp(layout: ParallelLayout) -> bool:
    """FSDP only where there is something to shard over; one data-parallel rank trains the plain model."""
    return layout.data_parallel == "fsdp" and layout.dp > 1


def parallelize_model(model_cfg: ModelConfig, job: JobConfig, layout: ParallelLayout, mesh: DeviceMesh,
                      device: torch.device, state_dict: dict | None = None) -> nn.Module:
    """A model ready to train. ``state_dict`` (full tensors, e.g. from Hugging Face) replaces random init."""
    model: Transformer = build_model(model_cfg, device="meta")
    apply_activation_checkpointing(model, job.train.activation_checkpoint)
    use_fsdp = uses_fsdp(layout)
    if use_fsdp:
        apply_fsdp(model, dp_mesh_for(layout, mesh), job.precision.dtype, job.parallel.reshard_after_forward)
    model.to_empty(device=device)
    if state_dict is None:
        model.init_weights(job.train.seed)
    else:
        load_full_state_dict(model, state_dict)
    if not use_fsdp and layout.dp > 1:
        model = apply_ddp(model, dp_mesh_for(layout, mesh))
    return model


def load_full_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Copy full (unsharded) tensors into a possibly sharded model; every rank keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))


def unwrap(model: nn.Module) -> Transformer:
    """The Transformer inside DDP (FSDP2 and checkpoint wrappers keep the module itself)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, Transformer) else model
