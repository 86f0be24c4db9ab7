"""Forward and backward of one optimizer step through a pipeline schedule.

The step's micro-batches (the same ones, in the same order, as gradient accumulation would use) are
concatenated and handed to the schedule, which splits them again into ``n_microbatches`` and runs its
forward/backward order (GPipe, 1F1B, interleaved, zero-bubble). The schedule divides gradients by the
number of micro-batches, so the result equals accumulation exactly.
"""

from __future__ import annotations

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
        loss, parts = model_loss(output, labels, self.mtp_weight)
        mtp = parts.get("mtp_loss", torch.zeros((), device=loss.device))
        self.records.append(torch.stack([loss.detach().float(), parts["lm_loss"].float(), mtp.float()]))
        return self.scaler.scale_loss(loss)


def pipeline_forward_backward(ctx, spans: dict) -> torch.Tensor:
    """[loss, lm loss, mtp loss] summed as over the step's ``accum_steps`` accumulation micro-batches, for
    a ``seektrain.train.step.StepContext``; the data wait and forward+backward go to ``spans``. The
    pipeline's own micro-batch count may differ (``parallel.pp_microbatches``): its mean loss is scaled
    back to ``accum_steps`` of them, which the step then divides out again."""
    plan, pm, loss_fn = ctx.plan, ctx.parallel, ctx.pipeline_loss
    t0 = ctx.clock.mark()
    batches = [next(ctx.batches) for _ in range(plan.accum_steps)]
    # non_blocking: a blocking copy to the device waits for the stream (the prefetched batches are pinned)
    tokens = torch.cat([b.tokens for b in batches]).to(ctx.device, non_blocking=True)
    labels = torch.cat([b.labels for b in batches]).to(ctx.device, non_blocking=True)
    t1 = ctx.clock.mark()
    last = pm.has_last_stage
    args = ((tokens, labels) if plan.use_mtp else (tokens,)) if pm.has_first_stage else ()
    loss_fn.records.clear()
    with ctx.autocast, plan.loss_context():
        if last:
            pm.schedule.step(*args, target=labels, losses=[])
        else:
            pm.schedule.step(*args)
    # The schedule's first step also runs each stage once to infer shapes (on placeholder inputs):
    # keep only this step's micro-batches in the losses and the expert-load counts.
    n_micro = plan.pp_microbatches
    for moe in moe_layers(pm.model):
        del moe.expert_counts[:-n_micro]
    if last:
        loss_sum = torch.stack(loss_fn.records[-n_micro:]).mean(0) * plan.accum_steps
    else:
        loss_sum = torch.zeros(3, device=ctx.device)
    dist.all_reduce(loss_sum, group=plan.meshes.pp.get_group())  # every rank learns the last stage's loss
    spans["data_wait_s"].append((t0, t1))
    spans["fwd_bwd_s"].append((t1, ctx.clock.mark()))
    return loss_sum
