"""Forward and backward of one optimizer step through a pipeline schedule.

The step's micro-batches (the same ones, in the same order, as gradient accumulation would use) are
concatenated and handed to the schedule, which splits them again into ``n_microbatches`` and runs its
forward/backward order (GPipe, 1F1B, interleaved, zero-bubble). The schedule divides gradients by the
number of micro-batches, so the result equals accumulation exactly.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from seektrain.train.balance import moe_layers
from seektrain.train.loss import model_loss
from seektrain.train.precision import DynamicLossScaler


class PipelineLoss:
    """``loss_fn`` of the schedule (runs on the last stage): our loss of one micro-batch, scaled for
    fp16, with the unscaled parts recorded for logging."""

    def __init__(self, scaler: DynamicLossScaler, mtp_weight: float):
        self.scaler, self.mtp_weight = scaler, mtp_weight
        self.records: list[torch.Tensor] = []

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple):
            output = (output[0], list(output[1:])) if len(output) > 1 else output[0]
        loss, parts = model_loss(output, labels, self.mtp_weight)
        mtp = parts.get("mtp_loss", torch.zeros((), device=loss.device))
        self.records.append(torch.stack([loss.detach().float(), parts["lm_loss"].float(), mtp.float()]))
        return self.scaler.scale_loss(loss)


def pipeline_forward_backward(ctx) -> tuple[torch.Tensor, float, float]:
    """([loss, lm loss, mtp loss] summed as over the step's ``accum_steps`` accumulation micro-batches,
    data wait s, forward+backward s). The pipeline's own micro-batch count may differ
    (``parallel.pp_microbatches``): its mean loss is scaled back to ``accum_steps`` of them, which the
    step then divides out again."""
    pm, loss_fn = ctx.pipeline, ctx.pipeline_loss
    t0 = time.perf_counter()
    batches = [next(ctx.loader) for _ in range(ctx.accum_steps)]
    tokens = torch.cat([b[0] for b in batches]).to(ctx.device)
    labels = torch.cat([b[1] for b in batches]).to(ctx.device)
    t1 = time.perf_counter()
    first, last = 0 in pm.stage_ids, pm.has_last_stage
    args = ((tokens, labels) if ctx.use_mtp else (tokens,)) if first else ()
    loss_fn.records.clear()
    with ctx.autocast, ctx.loss_context():
        if last:
            pm.schedule.step(*args, target=labels, losses=[])
        else:
            pm.schedule.step(*args)
    # The schedule's first step also runs each stage once to infer shapes (on placeholder inputs):
    # keep only this step's micro-batches in the losses and the expert-load counts.
    n_micro = pm.schedule._n_microbatches
    for moe in moe_layers(pm.model):
        del moe.expert_counts[:-n_micro]
    if last:
        loss_sum = torch.stack(loss_fn.records[-n_micro:]).mean(0) * ctx.accum_steps
    else:
        loss_sum = torch.zeros(3, device=ctx.device)
    if ctx.pp_group is not None:  # every rank learns the loss the last stage computed
        dist.all_reduce(loss_sum, group=ctx.pp_group)
    return loss_sum, t1 - t0, time.perf_counter() - t1
