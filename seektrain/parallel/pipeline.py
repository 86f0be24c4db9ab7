"""Pipeline parallelism with ``torch.distributed.pipelining``: cut the model into this rank's stages and
build the schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble V).

A stage is the same model (a ``Transformer``, or any registered family's module) with the layers it does
not own deleted, and the embedding (first stage only) or the final norm, head and MTP modules (last stage
only) set to ``None``, as its family's pipeline rules say (``models/registry.py``); the model's own
forward skips what is missing. Parameter names — and so checkpoints — are those of the whole model.
With MTP, the first stage also embeds the labels and the pipeline carries those embeddings to the last
stage, where the MTP modules need them; their gradient flows back through the pipeline to the one
embedding table. Positions and document ids of packed rows are keyword arguments of every stage
(``train/pipeline_step.py``). Which layers each stage holds is decided by the run plan
(seektrain/plan/pipeline_split.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from seektrain.models import ModelOutput
from seektrain.models.registry import family_of
from seektrain.parallel.mesh import Meshes
from seektrain.plan.pipeline_split import MULTI_STAGE, stage_ids

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}


def build_stage_model(
    model: nn.Module, layers: list[int] | tuple[int, ...], first: bool, last: bool
) -> nn.Module:
    """A copy of the (meta-device) model keeping only what one stage needs, by its family's pipeline
    rules (``models/registry.py``)."""
    rules = family_of(model).pipeline
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    blocks = getattr(stage, rules.layers)
    for key in list(blocks.keys()):
        if key not in keep:
            del blocks[key]
    for name in (() if first else rules.first) + (() if last else rules.last):
        setattr(stage, name, None)
    stage.register_forward_hook(_to_wire)
    return stage


def _to_wire(_module, _args, output: ModelOutput) -> tuple[torch.Tensor, ...]:
    """The schedule takes tuples of tensors only (it sends them, and checks the last stage's too): a
    stage before the last returns its ``ModelOutput.hidden``, the last its logits then each MTP depth's."""
    if output.hidden:
        return output.hidden
    assert output.logits is not None, "the last stage returns its logits"
    return (output.logits, *output.mtp)


def from_wire(output: tuple[torch.Tensor, ...] | torch.Tensor) -> ModelOutput:
    """The last stage's ``ModelOutput`` from what ``_to_wire`` made of it (for the schedule's loss). A
    model without MTP sends ``(logits,)``, which the schedule hands its loss as the bare tensor."""
    if isinstance(output, torch.Tensor):
        output = (output,)
    logits, *mtp = output
    return ModelOutput(logits=logits, mtp=tuple(mtp))


def rank_stages(model: nn.Module, plan, pp_rank: int) -> tuple[list[nn.Module], list[int]]:
    """(stage models, global stage indices) that pipeline rank ``pp_rank`` runs under ``plan``."""
    n_stages = len(plan.pp_stage_layers)
    ids = stage_ids(pp_rank, plan.pp, plan.pp_stages_per_rank, plan.job.parallel.pp_schedule)
    parts = [build_stage_model(model, plan.pp_stage_layers[i], i == 0, i == n_stages - 1) for i in ids]
    return parts, ids


def build_schedule(
    stage_modules: list[nn.Module], ids: list[int], plan, meshes: Meshes, device: torch.device, loss_fn
):
    """The schedule over this rank's stages, sending over ``meshes.pp`` (a ``parallel.mesh.Meshes``).
    Stages rebuild the DTensor activations they receive (tensor parallelism) by looking up the mesh they
    name in the one world mesh."""
    world = meshes.world

    def get_mesh(dim_names, _layout):
        return world[dim_names if len(dim_names) > 1 else dim_names[0]]

    n_stages = len(plan.pp_stage_layers)
    stages = [
        PipelineStage(m, i, n_stages, device, group=meshes.pp.get_group(), get_mesh=get_mesh)
        for m, i in zip(stage_modules, ids)
    ]
    schedule = plan.job.parallel.pp_schedule
    cls = SCHEDULES[schedule]
    if schedule in MULTI_STAGE:
        return cls(stages, n_microbatches=plan.pp_microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=plan.pp_microbatches, loss_fn=loss_fn)
