"""Forward and backward of one optimizer step through a pipeline schedule.

The step's micro-batches (the same ones, in the same order, as gradient accumulation would use) are
concatenated and handed to the schedule, which splits them again into ``n_microbatches`` and runs its
forward/backward order (GPipe, 1F1B, interleaved, zero-bubble). Positions and document ids of packed
rows go to every stage as keyword arguments (the schedule splits them like the tokens); the hidden
states travel between stages. Every micro-batch's loss is its cross-entropy sum over the step's
trained-token count (``train/loss.py``), times the schedule's micro-batch count, which the schedule
divides the gradients by again; so the result equals accumulation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seektrain.data.batch import Batch
from seektrain.parallel.context_parallel import local_batch
from seektrain.parallel.pipeline import from_wire
from seektrain.train.balance import keep_last_forwards
from seektrain.train.loss import model_loss, step_denominators
from seektrain.train.precision import DynamicLossScaler


class PipelineLoss:
    """``loss_fn`` of the schedule (runs on the last stage): our loss of one micro-batch, scaled for
    fp16, with the unscaled parts recorded for logging. ``denominators`` are the step's (set before each
    step). The target is the labels [B, T], or for packed rows labels and document ids stacked [B, T, 2]
    (``pipeline_target``): the schedule splits it like the inputs, and MTP needs the document ids.
    ``head_targets``: the target is every head's targets already [B, T, 1 + depths] (context
    parallelism with MTP, ``data/batch.py``), which need no document ids."""

    def __init__(self, scaler: DynamicLossScaler, mtp_weight: float, head_targets: bool = False):
        self.scaler, self.mtp_weight, self.head_targets = scaler, mtp_weight, head_targets
        self.records: list[torch.Tensor] = []
        self.denominators: torch.Tensor | None = None

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        if self.head_targets or target.dim() == 2:
            labels, document_ids = target, None
        else:
            labels, document_ids = (t.contiguous() for t in target.unbind(-1))
        loss, parts = model_loss(from_wire(output), labels, self.mtp_weight, document_ids, self.denominators)
        mtp = parts.get("mtp_loss", torch.zeros((), device=loss.device))
        self.records.append(torch.stack([loss.detach().float(), parts["lm_loss"].float(), mtp.float()]))
        return self.scaler.scale_loss(loss)


def pipeline_target(batch: Batch) -> torch.Tensor:
    """The schedule's target for ``batch`` (see ``PipelineLoss``)."""
    if batch.document_ids is None or batch.labels.dim() == 3:
        return batch.labels
    return torch.stack([batch.labels, batch.document_ids], dim=-1)


def pipeline_inputs(plan, pm, batches: list[Batch], device: torch.device) -> tuple[tuple, dict, Batch]:
    """(positional arguments, keyword arguments, the concatenated batch) of one schedule call."""

    def joined(name: str) -> torch.Tensor | None:
        return None if getattr(batches[0], name) is None else torch.cat([getattr(b, name) for b in batches])

    cat = Batch(
        torch.cat([b.tokens for b in batches]),
        torch.cat([b.labels for b in batches]),
        joined("positions"),
        joined("document_ids"),
        joined("mtp_tokens"),
    )
    # non_blocking: a blocking copy to the device waits for the stream (the prefetched batches are pinned)
    cat = cat.to(device, non_blocking=True)
    mtp_tokens = cat.tokens if cat.mtp_tokens is None else cat.mtp_tokens
    args = ((cat.tokens, mtp_tokens) if plan.use_mtp else (cat.tokens,)) if pm.has_first_stage else ()
    kwargs = {
        name: t
        for name, t in (("positions", cat.positions), ("document_ids", cat.document_ids))
        if t is not None
    }
    return args, kwargs, cat


def pipeline_forward_backward(ctx, spans: dict) -> torch.Tensor:
    """[loss, lm loss, mtp loss] summed over the step's micro-batches (each normalised by the step's
    trained tokens), for a ``seektrain.train.step.StepContext``; the data wait and forward+backward go
    to ``spans``."""
    plan, pm, loss_fn = ctx.plan, ctx.parallel, ctx.pipeline_loss
    t0 = ctx.clock.mark()
    batches = [local_batch(plan, ctx.meshes, next(ctx.batches)) for _ in range(plan.accum_steps)]
    args, kwargs, cat = pipeline_inputs(plan, pm, batches, ctx.device)
    n_micro = plan.pp_microbatches
    # the schedule divides the gradients by its micro-batch count: multiply it back into the loss
    loss_fn.records.clear()
    loss_fn.denominators = step_denominators(plan, ctx.meshes, [cat]) / n_micro
    t1 = ctx.clock.mark()
    last = pm.has_last_stage
    with ctx.autocast, plan.loss_context():
        if last:
            pm.schedule.step(*args, target=pipeline_target(cat), losses=[], **kwargs)
        else:
            pm.schedule.step(*args, **kwargs)
    # The schedule's first step also runs each stage once to infer shapes: keep only this step's
    # micro-batches in the losses, the expert-load counts and the router entropy.
    keep_last_forwards(pm.model, ctx.router_entropy, n_micro)
    if last:  # the records hold each micro-batch's share x n_micro
        loss_sum = torch.stack(loss_fn.records[-n_micro:]).sum(0) / n_micro
    else:
        loss_sum = torch.zeros(3, device=ctx.device)
    dist.all_reduce(loss_sum, group=ctx.meshes.pp.get_group())  # every rank learns the last stage's loss
    spans["data_wait_s"].append((t0, t1))
    spans["fwd_bwd_s"].append((t1, ctx.clock.mark()))
    return loss_sum
