"""The training job: resolve the run plan, build what the step needs from it, resume if asked, run
``train.steps`` optimizer steps, evaluate, checkpoint and summarise.

Runs as one process or as one worker of a torchrun/elastic launch; everything that differs between
the two is hidden in ``init_distributed`` and the run's meshes (``build_meshes(plan)``, built once
here and passed to the model's parallelisation, the step and the evaluation). ``train`` reads as the
sequence it is; each step of the sequence is a function below or a module of its own.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.checkpoint.atomic import write_text_atomic
from seektrain.checkpoint.lora_checkpoint import LORA, lora_record
from seektrain.checkpoint.manager import CheckpointManager, step_dir_name
from seektrain.checkpoint.resume import restore_trainer_state
from seektrain.checkpoint.run_files import MODEL_CONFIG
from seektrain.checkpoint.shared_dir import check_shared_run_dir
from seektrain.config.loader import config_to_toml
from seektrain.config.schema import JobConfig
from seektrain.data.blocks import ShardDamaged
from seektrain.data.tokenizer_files import copy_to_run
from seektrain.errors import user_path
from seektrain.models import build_model
from seektrain.models.lora import trainable_counts
from seektrain.parallel.dist_env import write_env_file
from seektrain.parallel.layout_record import layout_ran
from seektrain.parallel.mesh import Meshes, build_meshes
from seektrain.parallel.parallelize import parallelize_model, unwrap
from seektrain.parallel.process_group import DistEnv, init_distributed, release_environment
from seektrain.plan.run_plan import RunPlan
from seektrain.platform import policy_for
from seektrain.train.balance import configure_aux_loss
from seektrain.train.evaluate import Evaluator
from seektrain.train.loss_guard import LossGuard
from seektrain.train.monitor import RunMonitor
from seektrain.train.optim import build_optimizer, build_scheduler
from seektrain.train.pipeline_step import PipelineLoss
from seektrain.train.precision import DynamicLossScaler
from seektrain.train.preemption import Preemption
from seektrain.train.progress import setup_logging
from seektrain.train.readable_failure import FailedAt, readable_failure
from seektrain.train.run_hooks import run_hook
from seektrain.train.setup_data import TrainingData, open_training_data
from seektrain.train.setup_model import check_same_folder
from seektrain.train.startup import resolve_start
from seektrain.train.step import StepContext, train_step
from seektrain.train.step_log import StepLog
from seektrain.train.step_sync import StepSync

log = logging.getLogger("seektrain.train")


def train(cfg: JobConfig) -> dict:
    # [faults] SIGTERM is handled from here on, at every moment of the run (preemption.py)
    preemption = Preemption(cfg.checkpoint.preempt_grace_s)
    preemption.run_dir = Path(cfg.run.dir)
    run_hook("at_startup", preemption.rank, preemption)  # [faults] the tests' hooks; nothing otherwise
    try:
        with preemption.start_up():
            preemption.phase = "process-group initialisation"
            env = init_distributed(cfg.dist)
        try:
            return _train(cfg, env, preemption)
        finally:
            release_environment(env)  # a world of one leaves no torchrun variables nor process group behind
    finally:
        preemption.close()


def _train(cfg: JobConfig, env: DistEnv, preemption: Preemption) -> dict:
    # everything before the first step: checks, plan, data, model, resume; a SIGTERM until the first
    # step leaves at once and writes nothing (preemption.py)
    with preemption.start_up():
        run_dir = Path(cfg.run.dir)
        preemption.phase = "the run.dir checks"
        ckpt = CheckpointManager(
            run_dir,
            cfg.checkpoint.keep,
            cfg.checkpoint.async_save,
            env.rank,
            pin_memory=policy_for(env.device).pin_host_memory(),
            on_write_error=cfg.checkpoint.on_write_error,
            adapters_only=cfg.lora.enabled,  # [lora] the frozen base is never written into checkpoints
        )
        run_hook("at_data", env.rank)  # [faults] the tests' shard damaged mid-run; nothing otherwise
        preemption.open_group()  # [faults] the ranks agree on a SIGTERM during an evaluation or a save
        # before any work: every rank sees rank 0's run.dir
        check_shared_run_dir(run_dir, env.rank, ckpt.group)
        # [checkpoint] checkpoint.resume: rank 0 decides (and sets aside what a fresh start leaves behind),
        # every rank gets the same checkpoint and model, or the same one-line refusal; then parallel.auto
        # and the run plan, exactly as the launcher resolved them (startup.py)
        preemption.phase = "the choice of checkpoint to resume from"
        choose = functools.partial(ckpt.resume_choice, uninterrupted=preemption.uninterrupted)
        begin = resolve_start(cfg, env.world_size, env.device.type, choose)
        plan, start, cfg = begin.plan, begin.resume, begin.plan.job
        meshes = build_meshes(plan)  # every DeviceMesh of the run; every rank builds them here
        plan.platform.prepare_process(cfg.train.deterministic, cfg.cpu.keep_freed_memory)
        write_run_files(plan, run_dir, env)
        setup_logging(run_dir, env.rank)
        if begin.auto_why:
            log.info(begin.auto_why)
        log.info(plan.precision.why)  # [precision] precision.dtype, auto decided for this device
        torch.manual_seed(cfg.train.seed)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)

        preemption.phase = "opening the training data (its manifest check)"
        data = open_training_data(
            cfg,
            plan.model,
            meshes.dp_rank,
            plan.dp,
            env.is_main,
            env.device if plan.platform.pin_host_memory() else None,
        )
        if env.is_main:  # the tokenizer and its chat template travel with the run (data/tokenizer_files.py)
            log.info(copy_to_run(data.dataset.manifest, run_dir))
        loss_guard = LossGuard(cfg.train.on_bad_loss, cfg.train.spike_factor, env.device)  # [faults]
        sync = StepSync(preemption, env.device)  # [faults] SIGTERM and async commits: one all-reduce a step
        run_hook("at_steps", sync, env.rank)  # [faults] the tests' SEEKTRAIN_TEST_* hooks; nothing otherwise
        # [lora] a LoRA checkpoint holds no base: it is read again from model.hf_path (or re-initialised)
        hf_path = (cfg.model.hf_path or None) if start.checkpoint is None or plan.lora else None
        if hf_path:
            check_same_folder(hf_path, env.world_size)  # every rank reads its slices of one model
        preemption.phase = "building the model" + (f" and reading {hf_path}" if hf_path else "")
        ctx = build_step_context(plan, meshes, env.device, data, loss_guard, hf_path)
        start_step = 0
        if start.checkpoint is not None:
            preemption.phase = f"loading checkpoint {start.checkpoint}"
            state = ckpt.load(start.checkpoint, ctx.model, ctx.optimizer)
            start_step = restore_trainer_state(state, ctx.scheduler, ctx.scaler, data.batches, loss_guard)
            log.info("resumed from %s at step %d", start.checkpoint, start_step)
        preemption.phase = "the last start-up checks"
        log_layout(plan, ctx, data, env)
        evaluator = Evaluator(plan, meshes, data.path, env.device)
        monitor = RunMonitor(
            plan,
            run_dir,
            env.rank,
            env.local_rank,
            env.device,
            start_step,
            resumed=start.checkpoint is not None,
        )
        trainer_state = _trainer_state_fn(
            plan, ctx, data, loss_guard, env, lora_record(cfg, plan.model, plan.compute_dtype)
        )
        # per-step values stay on the device until a flush step reads them (step_log.py)
        steps_log = StepLog(
            monitor, ctx.loss_guard, env.device, cfg.run.log_interval, start_step + 1, cfg.train.steps
        )
    ctx.model.train()
    t_run = time.perf_counter()
    step = start_step
    try:
        for step in range(start_step + 1, cfg.train.steps + 1):
            sync.begin_step(step)  # [faults] what a collective failure names
            monitor.before_step(step)
            record = train_step(ctx, step)
            evaluating = evaluator.due(step)
            abandoned = False  # [faults] the evaluation gave way to a SIGTERM: this step is saved as it is
            if evaluating:
                preemption.phase = f"the evaluation after step {step}"
                val_loss = evaluator.val_loss(ctx, stop=preemption.agreed)
                abandoned = val_loss is None
                if not abandoned:
                    record.values["val_loss"] = val_loss
            steps_log.add(step, record)
            saving = (
                bool(cfg.checkpoint.interval)
                and step % cfg.checkpoint.interval == 0
                and step < cfg.train.steps
                and not abandoned
            )
            if saving:
                steps_log.settle()  # [faults] a bad loss stops the run before a checkpoint holds its step
                preemption.phase = f"the checkpoint of step {step}"
                ckpt.save(step, ctx.model, ctx.optimizer, trainer_state(step), retry_later=True)
            # [faults] a SIGTERM during a sync save that was committed: that save is the preemption's
            saved = saving and not ckpt.async_save and ckpt.last_step == step
            if abandoned or (saved and preemption.agreed()):
                preempted, written = True, None
            else:  # [faults] one all-reduce: SIGTERM on any rank, and an async checkpoint written everywhere
                preempted, written = sync.end_step(step, ckpt.in_flight(), ckpt.pending_step)
            ckpt.commit(written)
            stall = ckpt.take_stall_s()  # what this step's checkpoint save or commit blocked training for
            if stall is not None:
                record.values["checkpoint_stall_s"] = stall
            monitor.after_step(step, record.values)
            if saving or evaluating or preempted or steps_log.due(step):
                steps_log.flush()
            if preempted:  # [faults] SIGTERM on any rank: every rank saves this step, exits 143
                ckpt.save(step, ctx.model, ctx.optimizer, trainer_state(step), blocking=True)
                what = f"stopped after step {step} and saved {ckpt.root / step_dir_name(step)}"
                if abandoned:
                    what += f" (the evaluation after step {step} was abandoned: no val_loss for it)"
                raise preemption.leave(what)
        steps_log.flush()
        if step > start_step or start.checkpoint is None:
            ckpt.save(step, ctx.model, ctx.optimizer, trainer_state(step))
        ckpt.wait()
    except BaseException as err:
        steps_log.salvage(err)  # the steps completed before the error still reach metrics.jsonl
        if isinstance(err, ShardDamaged):  # [data] every rank stops at this batch: keep the save in flight
            ckpt.wait()
        if isinstance(err, (RuntimeError, MemoryError)):  # [faults] out of memory, a dead or hung rank
            at = FailedAt(env.rank, sync.step, preemption.phase, env.facts, cfg.dist.collective_timeout_s)
            failure = readable_failure(err, plan, at)
            if failure is not None:
                raise failure from None
        raise
    finally:
        data.close()  # the prefetch thread ends here: after the last step, on errors and on preemption
        ckpt.close()
        monitor.close()
    summary = monitor.summarise(
        time.perf_counter() - t_run, _local_numel(ctx.model), layout_ran(ctx.parallel, meshes.world)
    )
    if dist.is_initialized():
        dist.barrier()
    return {
        "final_step": step,
        "records": monitor.records,
        "summary": summary,
        "model": unwrap(ctx.model) if env.world_size == 1 else None,
    }


def write_run_files(plan: RunPlan, run_dir: Path, env: DistEnv) -> None:
    """``config.toml`` and ``model_config.json``: what this run is, for resume, sample and convert."""
    if env.is_main:
        with user_path(f"run.dir={run_dir}"):
            run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.toml", config_to_toml(plan.job))
        write_text_atomic(run_dir / MODEL_CONFIG, json.dumps(plan.model.to_dict(), indent=1))
        write_env_file(run_dir, env.backend, env.facts, plan.job.dist)


def build_step_context(
    plan: RunPlan,
    meshes: Meshes,
    device: torch.device,
    data: TrainingData,
    loss_guard: LossGuard,
    hf_path: str | None,
) -> StepContext:
    """The model (built on the meta device, parallelised over ``meshes``, then materialised), its
    optimizer and schedule, the loss scaler and the batches: everything a step changes."""
    job = plan.job
    scaler = DynamicLossScaler(
        plan.precision.name == "fp16",
        job.precision.loss_scale_init,
        job.precision.loss_scale_growth_interval,
        device=device,
    )
    pipeline_loss = (
        PipelineLoss(scaler, job.train.mtp_loss_weight, head_targets=plan.cp > 1 and plan.use_mtp)
        if plan.pp > 1
        else None
    )
    model = build_model(plan.model, device="meta", kernels=plan.platform.model_kernels(plan.compute_dtype))
    parallel = parallelize_model(model, plan, meshes, device, hf_path=hf_path, loss_fn=pipeline_loss)
    configure_aux_loss(parallel.model, job.train.aux_loss_alpha, plan.aux_loss_grad_scale)
    optimizer = build_optimizer(parallel.model, job.optim)
    scheduler = build_scheduler(optimizer, job.optim, job.train.steps)
    return StepContext(
        plan,
        meshes,
        device,
        parallel,
        optimizer,
        scheduler,
        scaler,
        data.batches,
        loss_guard,
        pipeline_loss,
        plan.autocast(device),
    )


def log_layout(plan: RunPlan, ctx: StepContext, data: TrainingData, env: DistEnv) -> None:
    trainable, frozen = trainable_counts(ctx.model)
    log.info(
        "model %s: %s; layout %s; grad accumulation %d; %d local parameter elements on rank 0 "
        "(%d trainable, %d frozen%s)",
        plan.model.name,
        data.describe(),
        plan.describe(),
        plan.accum_steps,
        _local_numel(ctx.model),
        trainable,
        frozen,
        f": LoRA rank {plan.lora.rank} on {', '.join(plan.lora.targets)}" if plan.lora else "",
    )
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, _local_bytes(ctx.model))
    log.info("parameter bytes per rank (MiB): %s", " ".join(f"{b / 2**20:.1f}" for b in per_rank))


def _trainer_state_fn(
    plan: RunPlan,
    ctx: StepContext,
    data: TrainingData,
    loss_guard: LossGuard,
    env: DistEnv,
    lora: dict | None,
):
    """``trainer_state.json`` of a checkpoint at a step: what DCP's shards do not hold (under LoRA also
    the reference to the base, ``checkpoint/lora_checkpoint.py``)."""

    def state(step: int) -> dict:
        extra = {LORA: lora} if lora else {}
        return {
            **extra,
            "step": step,
            "scheduler": ctx.scheduler.state_dict(),
            "scaler": ctx.scaler.state_dict(),
            "data": data.batches.state_dict(),
            "model_config": plan.model.name,
            "config": config_to_toml(plan.job),
            "faults": loss_guard.state_dict(),
            "world_size": env.world_size,
        }

    return state


def _local_params(model):
    from torch.distributed.tensor import DTensor

    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


def _local_numel(model) -> int:
    return sum(p.numel() for p in _local_params(model))


def _local_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in _local_params(model))
