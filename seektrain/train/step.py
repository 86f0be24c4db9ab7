"""One optimizer step, readable top to bottom: accumulate micro-batches, unscale/check, clip, step,
rebalance experts. Degrees, counts and flags come from the run plan, process groups from the run's
meshes (``seektrain.parallel.mesh.Meshes``); both, and the objects the step changes, are in its
``StepContext``.

The step never waits for the device (no ``.item()``, ``float()`` or ``bool()`` of a device tensor):
what to log comes back as a ``StepRecord`` of device values that ``seektrain.train.step_log`` reads at
the next flush step, and the decisions a step must take from its own numbers (skip a bad loss or an
overflow, rebalance experts only after an update) are taken on the device. The exceptions, which must
know sizes on the host, are expert parallelism's all-to-all splits and tensor-parallel experts' slot
range (``parallel/expert_parallel.py``, ``parallel/moe_tensor_parallel.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from seektrain.data.batch import Batch
from seektrain.observe.step_clock import Spans, StepClock
from seektrain.parallel.context_parallel import local_batch
from seektrain.parallel.mesh import Meshes
from seektrain.parallel.parallelize import ParallelModel
from seektrain.plan.run_plan import RunPlan
from seektrain.train.balance import (
    RouterEntropy,
    collect_expert_load,
    expert_imbalance,
    layer_table,
    update_balance_bias,
)
from seektrain.train.grad import clip_grad_norm
from seektrain.train.loss import model_loss, step_denominators
from seektrain.train.loss_guard import LossGuard, Verdict
from seektrain.train.pipeline_step import PipelineLoss, pipeline_forward_backward
from seektrain.train.precision import DynamicLossScaler


@dataclass
class StepContext:
    plan: RunPlan
    meshes: Meshes  # the run's DeviceMeshes (``build_meshes(plan)``): every group the step reduces over
    device: torch.device
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: DynamicLossScaler
    batches: Iterator[Batch]
    loss_guard: LossGuard  # [faults] bad-loss policy: skip or stop on NaN/Inf or a spike
    pipeline_loss: PipelineLoss | None = None  # the pipeline schedule's loss (pp > 1)
    autocast: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)
    clock: StepClock = field(init=False)
    router_entropy: RouterEntropy | None = field(init=False)  # MoE models: each layer's routing entropy

    def __post_init__(self) -> None:
        self.clock = StepClock(self.device)
        self.router_entropy = RouterEntropy(self.model) if self.plan.model.is_moe else None

    @property
    def model(self) -> nn.Module:
        return self.parallel.model


@dataclass
class StepRecord:
    """What a step reports. ``values``: metric name -> a number, a 0-dim device tensor or the ``Spans``
    of a phase, all read at the next flush; ``verdict``: the loss guard's, settled then."""

    values: dict
    verdict: Verdict
    read: bool = False  # values read on the host and the verdict settled (seektrain.train.step_log)


def _no_sync(model: nn.Module, last: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch (FSDP reduces every time)."""
    no_sync = getattr(model, "no_sync", None)
    if not last and no_sync is not None:
        return no_sync()
    return contextlib.nullcontext()


def model_inputs(plan: RunPlan, batch: Batch) -> dict:
    """The keyword arguments of the model's training forward for ``batch``."""
    mtp_tokens = batch.tokens if batch.mtp_tokens is None else batch.mtp_tokens
    return {
        "mtp_tokens": mtp_tokens if plan.use_mtp else None,
        "labels": batch.labels if plan.fused_loss else None,
        "positions": batch.positions,
        "document_ids": batch.document_ids,
    }


def accumulate(ctx: StepContext, step: int, spans: dict[str, Spans]) -> torch.Tensor:
    """Forward + backward of the step's micro-batches one after the other (gradient accumulation): the
    sum of [loss, lm loss, mtp loss] over micro-batches, each normalised by the step's trained tokens
    (``train/loss.py``); the data wait and forward+backward go to ``spans``. The micro-batches are read
    first, since the normalisation counts all of their trained tokens."""
    plan, accum, clock = ctx.plan, ctx.plan.accum_steps, ctx.clock
    loss_sum = torch.zeros(3, device=ctx.device)  # total, lm, mtp (summed over micro-batches)
    t0 = clock.mark()
    batches = [
        local_batch(plan, ctx.meshes, next(ctx.batches).to(ctx.device, non_blocking=True))
        for _ in range(accum)
    ]
    denominators = step_denominators(plan, ctx.meshes, batches)
    spans["data_wait_s"].append((t0, clock.mark()))
    for micro, batch in enumerate(batches):
        t1 = clock.mark()
        with _no_sync(ctx.model, micro == accum - 1):
            with ctx.autocast:
                out = ctx.model(batch.tokens, **model_inputs(plan, batch))
            with plan.loss_context():
                loss, parts = model_loss(
                    out, batch.labels, plan.job.train.mtp_loss_weight, batch.document_ids, denominators
                )
                ctx.scaler.scale_loss(loss).backward()
        loss_sum += torch.stack(
            [
                loss.detach().float(),
                parts["lm_loss"].float(),
                parts.get("mtp_loss", torch.zeros((), device=ctx.device)).float(),
            ]
        )
        spans["fwd_bwd_s"].append((t1, clock.mark()))
    return loss_sum


def train_step(ctx: StepContext, step: int) -> StepRecord:
    plan, clock = ctx.plan, ctx.clock
    spans = {name: Spans() for name in ("step_time_s", "data_wait_s", "fwd_bwd_s", "optim_s", "comm_s")}
    t_start = clock.mark()
    if plan.pp > 1:
        loss_sum = pipeline_forward_backward(ctx, spans)
    else:
        loss_sum = accumulate(ctx, step, spans)

    # [faults] the data-parallel mean loss is known before the update, so every rank takes the same
    # skip/stop decision on a NaN/Inf or spiking loss (train.on_bad_loss, seektrain.train.loss_guard): on the
    # device, as a mask of the update; the host hears of it at the next flush (LossGuard.settle).
    # Communication we can time: these step-level reductions, including the wait for the slowest rank
    # (FSDP's and TP's collectives overlap compute inside fwd_bwd and are not separable there).
    dp_group = ctx.meshes.dp_cp.get_group()  # every rank whose tokens differ (data- and context-parallel)
    t_comm = clock.mark()
    if plan.dp_cp > 1:  # each rank's sum is its share of the step's mean x dp_cp (train/loss.py)
        dist.all_reduce(loss_sum, group=dp_group)
        loss_sum /= plan.dp_cp
    t_opt = clock.mark()
    spans["comm_s"].append((t_comm, t_opt))
    verdict = ctx.loss_guard.judge(loss_sum[0])

    params = [p for p in ctx.model.parameters() if p.grad is not None]
    overflow = ctx.scaler.unscale(params)  # fp16 only: did any rank's gradients overflow
    pp_group = ctx.meshes.pp.get_group() if plan.pp > 1 else None
    norm = clip_grad_norm(params, plan.job.train.grad_clip, pp_group)
    grads_ok = torch.isfinite(norm) if overflow is None else ~overflow & torch.isfinite(norm)
    update = (
        verdict.good & grads_ok
    )  # [faults] a bad loss drops the gradients without stepping or touching the scaler
    _step_unless(ctx.optimizer, ~update, params)
    ctx.scaler.update(grads_ok, counted=verdict.good)
    ctx.optimizer.zero_grad(set_to_none=True)
    lr = ctx.scheduler.get_last_lr()[0]
    ctx.scheduler.step()

    t_loads = clock.mark()
    loads = collect_expert_load(ctx.model, dp_group if plan.dp_cp > 1 else None)
    t_loads_end = clock.mark()
    spans["comm_s"].append((t_loads, t_loads_end))
    update_balance_bias(ctx.model, loads, plan.bias_update_speed, update)

    plan.platform.end_of_step()
    t_end = clock.mark()
    spans["optim_s"] += [(t_opt, t_loads), (t_loads_end, t_end)]
    spans["step_time_s"].append((t_start, t_end))
    reported = verdict.good if overflow is None else verdict.good & ~overflow
    values = {
        "loss": loss_sum[0],
        "lm_loss": loss_sum[1],
        "lr": lr,
        "grad_norm": torch.where(reported, norm, float("nan")),  # NaN: the norm was not taken into account
        "loss_scale": ctx.scaler.scale_value,
        "skipped": ~update,
        **spans,
    }
    if plan.use_mtp:
        values["mtp_loss"] = loss_sum[2]
    if plan.model.is_moe:
        values["expert_imbalance"] = _worst_imbalance(plan, loads, ctx.device, pp_group)
        assert ctx.router_entropy is not None  # built for every MoE model
        entropy = ctx.router_entropy.take(dp_group if plan.dp_cp > 1 else None)
        values["moe_layers"] = layer_table(  # read by train/step_log.py
            ctx.model,
            loads,
            entropy,
            plan.model.num_hidden_layers,
            plan.model.num_nextn_predict_layers,
            pp_group,
        )
    return StepRecord(values, verdict)


def _step_unless(
    optimizer: torch.optim.Optimizer, skip: torch.Tensor, params: Sequence[torch.Tensor]
) -> None:
    """``optimizer.step()``, which leaves parameters, moments and step counts untouched where ``skip``
    is set, decided on the device: torch's fused AdamW reads a ``found_inf`` flag (the one
    ``torch.amp.GradScaler`` hands it) and its step returns early. The flag goes to the parameters' own
    device: for CPU-offloaded parameters (``parallel.cpu_offload``) that copy waits for the device, as
    their optimizer, which runs on the host, has to anyway."""
    flag = skip.float()
    if params:
        home = params[0].to_local().device if isinstance(params[0], DTensor) else params[0].device
        flag = flag.to(home)
    optimizer.found_inf = flag  # type: ignore[attr-defined]  # read by fused AdamW; Optimizer's stubs lack it
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]  # as above: not in Optimizer's stubs


def _worst_imbalance(
    plan: RunPlan, loads: list[torch.Tensor], device: torch.device, pp_group
) -> torch.Tensor:
    """The worst MoE layer's imbalance over the whole model: a pipeline rank holds only its stages'
    layers, so the worst is taken over the pipeline ranks too (``pp_group``)."""
    worst = expert_imbalance(loads).double() if loads else torch.ones((), dtype=torch.float64, device=device)
    if plan.pp > 1:
        worst = worst.reshape(1)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp_group)
        worst = worst.reshape(())
    return worst
