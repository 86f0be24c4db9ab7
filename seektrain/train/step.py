"""One optimizer step, readable top to bottom: accumulate micro-batches, unscale/check, clip, step,
rebalance experts. Returns the numbers worth logging."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from seektrain.train import faults
from seektrain.train.balance import collect_expert_load, expert_imbalance, update_balance_bias
from seektrain.train.grad import clip_grad_norm
from seektrain.train.loss import model_loss
from seektrain.train.pipeline_step import pipeline_forward_backward
from seektrain.train.precision import DynamicLossScaler


@dataclass
class StepContext:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: DynamicLossScaler
    loader: object  # iterator of (tokens, labels)
    accum_steps: int
    autocast: contextlib.AbstractContextManager
    device: torch.device
    dp_group: dist.ProcessGroup | None
    grad_clip: float
    mtp_weight: float
    bias_update_speed: float
    use_mtp: bool
    # [faults] bad-loss policy (seektrain.train.faults.LossGuard; None = always update) and the step number
    loss_guard: faults.LossGuard | None = None
    step: int = 0
    # model parallelism: vocabulary-parallel loss (TP), the pipeline (PP) and its process group
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # the model computes head + cross-entropy fused (needs a head that is not vocabulary-sharded)
    fused_loss: bool = True
    # run at the end of every step, inside its timing (CPU: hand free heap pages back to the OS)
    end_of_step: Callable[[], None] | None = None
    pipeline: object | None = None  # seektrain.parallel.parallelize.ParallelModel with a schedule
    pipeline_loss: object | None = None
    pp_group: dist.ProcessGroup | None = None


def _no_sync(model: nn.Module, last: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch (FSDP reduces every time)."""
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def accumulate(ctx: StepContext) -> tuple[torch.Tensor, float, float]:
    """Forward + backward of the step's micro-batches one after the other (gradient accumulation):
    (sum of [loss, lm loss, mtp loss] over micro-batches, data wait s, forward+backward s)."""
    data_wait = fwd_bwd = 0.0
    loss_sum = torch.zeros(3, device=ctx.device)  # total, lm, mtp (summed over micro-batches)
    for micro in range(ctx.accum_steps):
        t0 = time.perf_counter()
        tokens, labels = next(ctx.loader)
        tokens, labels = tokens.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
        t1 = time.perf_counter()
        with _no_sync(ctx.model, micro == ctx.accum_steps - 1):
            with ctx.autocast:
                out = ctx.model(tokens, mtp_labels=labels if ctx.use_mtp else None,
                                labels=labels if ctx.fused_loss else None)
            with ctx.loss_context():
                loss, parts = model_loss(out, labels, ctx.mtp_weight)
                loss = faults.inject_nan(loss, ctx.step)  # [faults] test hook, inert unless SEEKTRAIN_TEST_NAN is set
                ctx.scaler.scale_loss(loss / ctx.accum_steps).backward()
        loss_sum += torch.stack([loss.detach().float(), parts["lm_loss"].float(),
                                 parts.get("mtp_loss", torch.zeros((), device=ctx.device)).float()])
        data_wait += t1 - t0
        fwd_bwd += time.perf_counter() - t1
    return loss_sum, data_wait, fwd_bwd


def train_step(ctx: StepContext) -> dict[str, float]:
    t_start = time.perf_counter()
    if ctx.pipeline is not None:
        loss_sum, data_wait, fwd_bwd = pipeline_forward_backward(ctx)
    else:
        loss_sum, data_wait, fwd_bwd = accumulate(ctx)

    # [faults] the data-parallel mean loss is known before the update, so every rank takes the same
    # skip/stop decision on a NaN/Inf or spiking loss (train.on_bad_loss, seektrain.train.faults).
    # Communication we can time: these step-level reductions, including the wait for the slowest rank
    # (FSDP's and TP's collectives overlap compute inside fwd_bwd and are not separable there).
    t_comm = time.perf_counter()
    if ctx.dp_group is not None and dist.get_world_size(ctx.dp_group) > 1:
        dist.all_reduce(loss_sum, group=ctx.dp_group)
        loss_sum /= dist.get_world_size(ctx.dp_group)
    loss_sum /= ctx.accum_steps
    comm_loss = time.perf_counter() - t_comm
    usable = ctx.loss_guard is None or ctx.loss_guard.check(float(loss_sum[0]), ctx.step)

    t_opt = time.perf_counter()
    params = [p for p in ctx.model.parameters() if p.grad is not None]
    finite, grad_norm = False, torch.tensor(float("nan"))
    if usable:  # [faults] a bad loss drops the gradients below without stepping or touching the scaler
        finite = ctx.scaler.unscale_and_check(params)
        grad_norm = clip_grad_norm(params, ctx.grad_clip, ctx.pp_group) if finite else torch.tensor(float("nan"))
        if finite and torch.isfinite(grad_norm):
            ctx.optimizer.step()
        else:
            finite = False
        ctx.scaler.update(finite)
    ctx.optimizer.zero_grad(set_to_none=True)
    lr = ctx.scheduler.get_last_lr()[0]
    ctx.scheduler.step()

    t_comm = time.perf_counter()
    loads = collect_expert_load(ctx.model, ctx.dp_group)
    comm_loads = time.perf_counter() - t_comm
    if finite:
        update_balance_bias(ctx.model, loads, ctx.bias_update_speed)

    if ctx.end_of_step is not None:
        ctx.end_of_step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    t_end = time.perf_counter()
    metrics = {
        "loss": float(loss_sum[0]), "lm_loss": float(loss_sum[1]), "lr": lr,
        "grad_norm": float(grad_norm), "loss_scale": ctx.scaler.scale, "skipped": int(not finite),
        "step_time_s": t_end - t_start, "data_wait_s": data_wait, "fwd_bwd_s": fwd_bwd,
        "optim_s": t_end - t_opt - comm_loads, "comm_s": comm_loss + comm_loads,
    }
    if ctx.use_mtp:
        metrics["mtp_loss"] = float(loss_sum[2])
    if loads:
        metrics["expert_imbalance"] = expert_imbalance(loads)
    return metrics
