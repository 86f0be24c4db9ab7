"""One optimizer step, readable top to bottom: accumulate micro-batches, unscale/check, clip, step,
rebalance experts. Returns the numbers worth logging. Degrees, counts and flags come from the run plan;
the objects the step changes are in its ``StepContext``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from seektrain.parallel.parallelize import ParallelModel
from seektrain.plan.run_plan import RunPlan
from seektrain.train import faults
from seektrain.train.balance import collect_expert_load, expert_imbalance, update_balance_bias
from seektrain.train.grad import clip_grad_norm
from seektrain.train.loss import model_loss
from seektrain.train.pipeline_step import PipelineLoss, pipeline_forward_backward
from seektrain.train.precision import DynamicLossScaler

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), [micro_batch_size, seq_len] each


@dataclass
class StepContext:
    plan: RunPlan
    device: torch.device
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: DynamicLossScaler
    batches: Iterator[Batch]
    loss_guard: faults.LossGuard  # [faults] bad-loss policy: skip or stop on NaN/Inf or a spike
    pipeline_loss: PipelineLoss | None = None  # the pipeline schedule's loss (pp > 1)
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext()

    @property
    def model(self) -> nn.Module:
        return self.parallel.model


def _no_sync(model: nn.Module, last: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch (FSDP reduces every time)."""
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def accumulate(ctx: StepContext, step: int) -> tuple[torch.Tensor, float, float]:
    """Forward + backward of the step's micro-batches one after the other (gradient accumulation):
    (sum of [loss, lm loss, mtp loss] over micro-batches, data wait s, forward+backward s)."""
    plan, accum = ctx.plan, ctx.plan.accum_steps
    data_wait = fwd_bwd = 0.0
    loss_sum = torch.zeros(3, device=ctx.device)  # total, lm, mtp (summed over micro-batches)
    for micro in range(accum):
        t0 = time.perf_counter()
        tokens, labels = next(ctx.batches)
        tokens, labels = tokens.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
        t1 = time.perf_counter()
        with _no_sync(ctx.model, micro == accum - 1):
            with ctx.autocast:
                out = ctx.model(tokens, mtp_labels=labels if plan.use_mtp else None,
                                labels=labels if plan.fused_loss else None)
            with plan.loss_context():
                loss, parts = model_loss(out, labels, plan.job.train.mtp_loss_weight)
                loss = faults.inject_nan(loss, step)  # [faults] test hook, inert unless SEEKTRAIN_TEST_NAN is set
                ctx.scaler.scale_loss(loss / accum).backward()
        loss_sum += torch.stack([loss.detach().float(), parts["lm_loss"].float(),
                                 parts.get("mtp_loss", torch.zeros((), device=ctx.device)).float()])
        data_wait += t1 - t0
        fwd_bwd += time.perf_counter() - t1
    return loss_sum, data_wait, fwd_bwd


def train_step(ctx: StepContext, step: int) -> dict[str, float]:
    plan = ctx.plan
    t_start = time.perf_counter()
    if plan.pp > 1:
        loss_sum, data_wait, fwd_bwd = pipeline_forward_backward(ctx)
    else:
        loss_sum, data_wait, fwd_bwd = accumulate(ctx, step)

    # [faults] the data-parallel mean loss is known before the update, so every rank takes the same
    # skip/stop decision on a NaN/Inf or spiking loss (train.on_bad_loss, seektrain.train.faults).
    # Communication we can time: these step-level reductions, including the wait for the slowest rank
    # (FSDP's and TP's collectives overlap compute inside fwd_bwd and are not separable there).
    dp_group = plan.meshes.dp.get_group()
    t_comm = time.perf_counter()
    if plan.dp > 1:
        dist.all_reduce(loss_sum, group=dp_group)
        loss_sum /= plan.dp
    loss_sum /= plan.accum_steps
    comm_loss = time.perf_counter() - t_comm
    usable = ctx.loss_guard.check(float(loss_sum[0]), step)

    t_opt = time.perf_counter()
    params = [p for p in ctx.model.parameters() if p.grad is not None]
    finite, grad_norm = False, torch.tensor(float("nan"))
    if usable:  # [faults] a bad loss drops the gradients below without stepping or touching the scaler
        finite = ctx.scaler.unscale_and_check(params)
        pp_group = plan.meshes.pp.get_group() if plan.pp > 1 else None
        grad_norm = clip_grad_norm(params, plan.job.train.grad_clip, pp_group) if finite else grad_norm
        if finite and torch.isfinite(grad_norm):
            ctx.optimizer.step()
        else:
            finite = False
        ctx.scaler.update(finite)
    ctx.optimizer.zero_grad(set_to_none=True)
    lr = ctx.scheduler.get_last_lr()[0]
    ctx.scheduler.step()

    t_comm = time.perf_counter()
    loads = collect_expert_load(ctx.model, dp_group if plan.dp > 1 else None)
    comm_loads = time.perf_counter() - t_comm
    if finite:
        update_balance_bias(ctx.model, loads, plan.bias_update_speed)

    plan.platform.end_of_step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    t_end = time.perf_counter()
    metrics = {
        "loss": float(loss_sum[0]), "lm_loss": float(loss_sum[1]), "lr": lr,
        "grad_norm": float(grad_norm), "loss_scale": ctx.scaler.scale, "skipped": int(not finite),
        "step_time_s": t_end - t_start, "data_wait_s": data_wait, "fwd_bwd_s": fwd_bwd,
        "optim_s": t_end - t_opt - comm_loads, "comm_s": comm_loss + comm_loads,
    }
    if plan.use_mtp:
        metrics["mtp_loss"] = float(loss_sum[2])
    if plan.model.is_moe:
        metrics["expert_imbalance"] = _worst_imbalance(plan, loads, ctx.device)
    return metrics


def _worst_imbalance(plan: RunPlan, loads: list[torch.Tensor], device: torch.device) -> float:
    """The worst MoE layer's imbalance over the whole model: a pipeline rank holds only its stages'
    layers, so the worst is taken over the pipeline ranks too."""
    worst = expert_imbalance(loads) if loads else 1.0
    if plan.pp > 1:
        value = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=plan.meshes.pp.get_group())
        worst = float(value)
    return worst
