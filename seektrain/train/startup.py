"""Start-up: from a job config to the run plan, one function for the launcher and every worker.

Why one: the launcher resolves the plan before any worker starts, so a layout that cannot work (or a model
that differs from the one the run dir holds) is refused once, with one line, and every worker resolves
the same plan again from the same inputs. The sequence (which checkpoint and model to start from →
``parallel.auto``'s layout → ``RunPlan.resolve`` with every check, the device's included) was written in
both places and had drifted once (the FP8 check sat outside ``resolve``); here it is written once.

The two callers differ only in how the checkpoint is chosen: the launcher reads the run dir and changes
nothing (``resolve_resume``); the workers' rank 0 also tidies it and shares the choice
(``CheckpointManager.resume_choice``).

``build_run`` then does every worker's whole start-up, in order: the run.dir checks, the plan, the meshes,
the run files and logging, the data, the model (built on meta, parallelised, filled from the release or
the checkpoint), the evaluator, the monitor and the step log. What it returns, a ``Run``, is everything
the training loop (``trainer.py``) touches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.checkpoint.atomic import write_text_atomic
from seektrain.checkpoint.finder import read_trainer_state
from seektrain.checkpoint.lora_checkpoint import LORA, check_lora_resume, lora_record
from seektrain.checkpoint.manager import CheckpointManager
from seektrain.checkpoint.resume import ResumeChoice, resolve_resume, restore_trainer_state, rope_text
from seektrain.checkpoint.run_files import MODEL_CONFIG
from seektrain.checkpoint.shared_dir import check_shared_run_dir
from seektrain.config.loader import config_to_toml
from seektrain.config.schema import JobConfig
from seektrain.data.tokenizer_files import copy_to_run
from seektrain.errors import UserError, user_path
from seektrain.models import build_model, with_rope_overrides
from seektrain.models.config import ModelConfig
from seektrain.models.job_model import configured_model_config, rope_overrides
from seektrain.models.lora import trainable_counts
from seektrain.parallel.dist_env import write_env_file
from seektrain.parallel.mesh import Meshes, build_meshes
from seektrain.parallel.parallelize import parallelize_model
from seektrain.parallel.process_group import DistEnv
from seektrain.plan.auto import auto_layout
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
from seektrain.train.run_hooks import run_hook
from seektrain.train.setup_data import TrainingData, open_training_data
from seektrain.train.setup_model import check_same_folder
from seektrain.train.step import StepContext
from seektrain.train.step_log import StepLog
from seektrain.train.step_sync import StepSync

log = logging.getLogger("seektrain.train")

ChooseResume = Callable[[str, ModelConfig], ResumeChoice]  # (checkpoint.resume, configured model) -> choice


@dataclass(frozen=True)
class Start:
    plan: RunPlan
    resume: ResumeChoice  # the checkpoint to load (None: a fresh start) and the model it holds
    auto_why: str  # parallel.auto's one line on the layout it chose; "" when off


def resolve_start(
    job: JobConfig,
    world_size: int,
    device_type: str,
    choose_resume: ChooseResume | None = None,
    ranks_per_node: int | None = None,
) -> Start:
    """The plan this job runs with on ``world_size`` processes of ``device_type``, or the one-line
    ``UserError`` that refuses it. ``choose_resume`` defaults to the read-only choice."""
    choose = choose_resume or (lambda spec, configured: resolve_resume(job.run.dir, spec, configured))
    resume = _rope_on_converted(choose(job.checkpoint.resume, configured_model_config(job)), job)
    if resume.checkpoint is not None:  # [lora] the same settings and base, or one line naming both
        check_lora_resume(resume.checkpoint, job, resume.model)
    job, why = auto_layout(job, resume.model, world_size, device_type, ranks_per_node)
    plan = RunPlan.resolve(job, resume.model, world_size, device_type, this_machine=True)
    return Start(plan, resume, why)


def _rope_on_converted(resume: ResumeChoice, job: JobConfig) -> ResumeChoice:
    """A run dir made by ``seektrain convert --to-checkpoint`` defines its model (``model.preset`` and
    ``model.hf_path`` are not used), but ``[model.rope_scaling]`` still applies on top of it: that is how
    a converted release is extended. Its weights-only checkpoint takes the overrides; a training
    checkpoint written since must already hold them (the same refusal as any other model change)."""
    if resume.converted_from is None or resume.checkpoint is None:
        return resume
    model = with_rope_overrides(resume.model, rope_overrides(job))
    if model == resume.model:
        return resume
    if not read_trainer_state(resume.checkpoint).get("weights_only"):
        raise UserError(
            f"checkpoint {resume.checkpoint} was trained with rope_scaling={rope_text(resume.model)} but "
            f"model.rope_scaling asks for {rope_text(model)}: keep the checkpoint's values, or start "
            "a new run.dir from its weights (seektrain convert, docs/training.md)"
        )
    return dataclasses.replace(resume, model=model)


@dataclass
class Run:
    """What the training loop touches: the plan and meshes, the step's context, the checkpoint manager,
    the data, the fault handling of a step (``sync``, ``preemption``), the evaluator, the monitor and the
    step log, and where the run starts (``start``: the checkpoint, if any; ``start_step``)."""

    plan: RunPlan
    meshes: Meshes
    env: DistEnv
    preemption: Preemption
    ckpt: CheckpointManager
    data: TrainingData
    ctx: StepContext
    sync: StepSync
    evaluator: Evaluator
    monitor: RunMonitor
    steps_log: StepLog
    trainer_state: Callable[[int], dict]  # step -> trainer_state.json of its checkpoint
    start: ResumeChoice
    start_step: int


def build_run(cfg: JobConfig, env: DistEnv, preemption: Preemption) -> Run:
    """Everything before the first step: checks, plan, meshes, data, model, resume. A SIGTERM until the
    first step leaves at once and writes nothing (``preemption.start_up``, around the whole of it)."""
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
        check_shared_run_dir(run_dir, env.rank, ckpt.group)  # before any work: every rank sees rank 0's
        # [checkpoint] checkpoint.resume: rank 0 decides (and sets aside what a fresh start leaves behind),
        # every rank gets the same checkpoint and model, or the same one-line refusal; then parallel.auto
        # and the run plan, exactly as the launcher resolved them (resolve_start)
        preemption.phase = "the choice of checkpoint to resume from"
        choose = functools.partial(ckpt.resume_choice, uninterrupted=preemption.uninterrupted)
        begin = resolve_start(cfg, env.world_size, env.device.type, choose)
        plan, start, cfg = begin.plan, begin.resume, begin.plan.job
        meshes = build_meshes(plan)  # every DeviceMesh of the run; every rank builds them here
        _prepare_process(plan, run_dir, env, begin.auto_why)
        preemption.phase = "opening the training data (its manifest check)"
        pinned = env.device if plan.platform.pin_host_memory() else None
        data = open_training_data(cfg, plan.model, meshes.dp_rank, plan.dp, env.is_main, pinned)
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
        resumed = start.checkpoint is not None
        monitor = RunMonitor(plan, run_dir, env.rank, env.local_rank, env.device, start_step, resumed=resumed)
        lora = lora_record(cfg, plan.model, plan.compute_dtype)
        trainer_state = _trainer_state_fn(plan, ctx, data, loss_guard, env, lora)
        # per-step values stay on the device until a flush step reads them (step_log.py)
        steps_log = StepLog(
            monitor, loss_guard, env.device, cfg.run.log_interval, start_step + 1, cfg.train.steps
        )
    return Run(
        plan,
        meshes,
        env,
        preemption,
        ckpt,
        data,
        ctx,
        sync,
        evaluator,
        monitor,
        steps_log,
        trainer_state,
        start,
        start_step,
    )


def _prepare_process(plan: RunPlan, run_dir: Path, env: DistEnv, auto_why: str) -> None:
    """The process as the plan wants it (platform settings, seeds, determinism), the run files and the
    log, and the first lines of the log: parallel.auto's choice and the precision's reason."""
    cfg = plan.job
    plan.platform.prepare_process(cfg.train.deterministic, cfg.cpu.keep_freed_memory)
    write_run_files(plan, run_dir, env)
    setup_logging(run_dir, env.rank)
    if auto_why:
        log.info(auto_why)
    log.info(plan.precision.why)  # [precision] precision.dtype, auto decided for this device
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)


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
        local_numel(ctx.model),
        trainable,
        frozen,
        f": LoRA rank {plan.lora.rank} on {', '.join(plan.lora.targets)}" if plan.lora else "",
    )
    per_rank = [0] * env.world_size  # placeholders: all_gather_object replaces each
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


def local_numel(model) -> int:
    return sum(p.numel() for p in _local_params(model))


def _local_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in _local_params(model))
