"""The training job: set up every component from one ``JobConfig``, resume if a checkpoint exists,
run ``train.steps`` optimizer steps, log, checkpoint and summarise.

Runs as one process or as one worker of a torchrun/elastic launch; everything that differs between
the two is hidden in ``init_distributed`` and the DeviceMesh.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.checkpoint.manager import CheckpointManager, step_dir_name
from seektrain.checkpoint.resume import reproducible_cpu_math, restore_trainer_state, run_model_config
from seektrain.config.loader import config_to_toml
from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.observe.flops import mfu, model_flops_per_token, peak_flops
from seektrain.observe.memory import gpu_stats, memory_stats
from seektrain.observe.sink import MetricsSink
from seektrain.observe.summary import format_summary, write_summary
from seektrain.parallel.distributed import init_distributed
from seektrain.parallel.checks import check_model_layout, pipeline_microbatches, resolve_model_config
from seektrain.parallel.layout import resolve_layout
from seektrain.parallel.parallelize import parallelize_model, unwrap, uses_fsdp
from seektrain.parallel.tensor_parallel import tp_loss_context
from seektrain.train.balance import configure_aux_loss
from seektrain.train.cpu_allocator import keep_freed_memory, release_free_memory
from seektrain.train.faults import FaultGuard
from seektrain.train.optim import build_optimizer, build_scheduler
from seektrain.train.pipeline_step import PipelineLoss
from seektrain.train.precision import DTYPES, DynamicLossScaler, autocast_context
from seektrain.train.progress import Progress, setup_logging
from seektrain.train.setup_data import open_training_data
from seektrain.train.setup_model import resolve_model
from seektrain.train.step import StepContext, train_step

log = logging.getLogger("seektrain.train")
MODEL_CONFIG = "model_config.json"


def train(cfg: JobConfig) -> dict:
    env = init_distributed(cfg.train.collective_timeout_s)
    layout, accum = resolve_layout(cfg, env.world_size)
    run_dir = Path(cfg.run.dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_to_toml(cfg))
    setup_logging(run_dir, env.rank)
    kept = False
    if env.device.type == "cpu" and cfg.train.cpu_keep_freed_memory:
        kept = keep_freed_memory()
        if not kept:
            log.info("train.cpu_keep_freed_memory: no glibc malloc here, left as it is")
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        reproducible_cpu_math()  # [checkpoint] bit-exact runs and resumes on CPU (MKL_CBWR)
    mesh = layout.build_mesh(env.device.type)
    dp_group = mesh["dp"].get_group()
    dp_rank, dp_size = mesh["dp"].get_local_rank(), layout.dp

    t = cfg.train

    # [checkpoint] rank 0 picks the newest valid checkpoint and broadcasts it; a run dir holding one
    # keeps its own model (seektrain.checkpoint.resume)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, env.rank)
    latest = ckpt.latest_valid()
    if latest is not None:  # the checkpoint has the weights: read only the configured model's config
        model_cfg, hf_state = run_model_config(run_dir, resolve_model_config(cfg)), None
    else:
        model_cfg, hf_state = resolve_model(cfg)
    if env.is_main:
        (run_dir / MODEL_CONFIG).write_text(json.dumps(model_cfg.to_dict(), indent=1))
    check_model_layout(cfg, model_cfg, layout, accum)
    data = open_training_data(cfg, model_cfg, dp_rank, dp_size, env.is_main)
    scaler = DynamicLossScaler(cfg.precision.dtype == "fp16", cfg.precision.loss_scale_init,
                               cfg.precision.loss_scale_growth_interval)
    pipeline_loss = PipelineLoss(scaler, t.mtp_loss_weight) if layout.pp > 1 else None
    parallel = parallelize_model(model_cfg, cfg, layout, mesh, env.device, state_dict=hf_state,
                                 loss_fn=pipeline_loss,
                                 n_microbatches=pipeline_microbatches(cfg, layout, accum) if layout.pp > 1 else 1)
    model = parallel.model
    del hf_state
    # The pipeline schedule divides all gradients by its micro-batch count itself.
    configure_aux_loss(model, t.aux_loss_alpha, 1.0 if layout.pp > 1 else 1.0 / accum)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, t.steps)

    guard = FaultGuard(t, cfg.checkpoint, ckpt, env.rank, env.device)  # [faults] SIGTERM, bad loss, hangs
    start_step = 0
    if latest is not None:
        state = ckpt.load(latest, model, optimizer)
        start_step = restore_trainer_state(state, scheduler, scaler, data.loader, guard.loss)
        log.info("resumed from %s at step %d", latest, start_step)

    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %s; layout %s; grad accumulation %d; %d local parameter elements on rank 0",
             model_cfg.name, data.describe(), layout.describe(), accum, _local_numel(model))
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, _local_bytes(model))
    log.info("parameter bytes per rank (MiB): %s", " ".join(f"{b / 2**20:.1f}" for b in per_rank))
    log.debug("global parameter count %d", n_params)

    tokens_per_step = t.global_batch_size * t.seq_len
    flops_per_token = model_flops_per_token(model_cfg, t.seq_len)
    peak, peak_source = peak_flops(env.device, DTYPES[cfg.precision.dtype])
    sink = MetricsSink(run_dir, rank=env.rank, prometheus_port=cfg.metrics.prometheus_port,
                       prometheus_host=cfg.metrics.prometheus_host, all_ranks_serve=cfg.metrics.all_ranks,
                       local_rank=env.local_rank, tensorboard=cfg.metrics.tensorboard)
    sink.set_run_info(run=cfg.run.name or run_dir.name, model=model_cfg.name, world_size=env.world_size)
    profiler = None
    if cfg.profile.steps and env.is_main:
        from seektrain.observe.profiler import StepProfiler

        profiler = StepProfiler(run_dir, cfg.profile.steps)
    ctx = StepContext(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, loader=iter(data.loader),
        accum_steps=accum, autocast=autocast_context(env.device, cfg.precision.dtype, uses_fsdp(layout)),
        device=env.device, dp_group=dp_group, grad_clip=t.grad_clip, mtp_weight=t.mtp_loss_weight,
        bias_update_speed=t.bias_update_speed if model_cfg.topk_method == "noaux_tc" else 0.0,
        use_mtp=model_cfg.num_nextn_predict_layers > 0 and t.mtp_loss_weight > 0, loss_guard=guard.loss,
        loss_context=lambda: tp_loss_context(layout.tp > 1), fused_loss=layout.tp == 1,
        end_of_step=release_free_memory if kept else None, pipeline=parallel if layout.pp > 1 else None,
        pipeline_loss=pipeline_loss, pp_group=mesh["pp"].get_group() if layout.pp > 1 else None)

    def trainer_state(step: int) -> dict:
        return {"step": step, "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "data": data.loader.state_dict(), "model_config": model_cfg.name,
                "config": config_to_toml(cfg), "faults": guard.loss.state_dict(), "world_size": env.world_size}

    records: list[dict] = []
    progress = Progress(start_step, t.steps, enabled=env.is_main and cfg.run.progress_bar)
    model.train()
    t_run = time.perf_counter()
    step = start_step
    try:
        for step in range(start_step + 1, t.steps + 1):
            guard.begin_step(step)  # [faults] (test hooks only)
            ctx.step = step
            if profiler:
                profiler.before_step(step)
            metrics = train_step(ctx)
            if profiler:
                profiler.after_step(step)
            metrics["tokens_per_s"] = tokens_per_step / metrics["step_time_s"]
            metrics["mfu"] = mfu(metrics["tokens_per_s"] / env.world_size, flops_per_token, peak)
            metrics.update(memory_stats(env.device))
            if env.device.type == "cuda":
                metrics.update(gpu_stats(env.device.index))  # NVML: utilisation, power (empty when absent)
            sink.log(step, metrics)
            records.append({"step": step, **metrics})
            progress.update(step, metrics)
            if step % cfg.run.log_interval == 0 or step == start_step + 1:
                progress.write(_format_line(step, t.steps, metrics))
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step < t.steps:
                ckpt.save(step, model, optimizer, trainer_state(step))
            if guard.end_step(step):  # [faults] SIGTERM on any rank: every rank saves this step, exits 143
                ckpt.save(step, model, optimizer, trainer_state(step), blocking=True)
                guard.exit_preempted(step, ckpt.root / step_dir_name(step))
        if step > start_step or latest is None:
            ckpt.save(step, model, optimizer, trainer_state(step))
        ckpt.wait()
    except RuntimeError as err:  # [faults] a dead or hung rank: one line naming this rank and the operation
        guard.raise_readable(err)
        raise
    finally:
        guard.close()
        progress.close()
        sink.close()
    wall = time.perf_counter() - t_run
    summary = {}
    if env.is_main and records:
        summary = write_summary(run_dir, records, {
            "wall_time_s": wall, "device_flops_peak": peak, "device_flops_source": peak_source,
            "flops_per_token": flops_per_token, "world_size": env.world_size, "layout": layout.describe(),
            "model": model_cfg.name, "tokens_per_step": tokens_per_step,
            "param_elements_rank0": _local_numel(model), "device": str(env.device)})
        log.info("%s", format_summary(summary))
    if dist.is_initialized():
        dist.barrier()
    return {"final_step": step, "records": records, "summary": summary,
            "model": unwrap(model) if env.world_size == 1 else None}


def _local_params(model):
    from torch.distributed.tensor import DTensor

    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


def _local_numel(model) -> int:
    return sum(p.numel() for p in _local_params(model))


def _local_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in _local_params(model))


def _format_line(step: int, total: int, m: dict) -> str:
    parts = [f"step {step}/{total}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"grad_norm {m['grad_norm']:.3f}",
             f"tok/s {m['tokens_per_s']:.0f}", f"mfu {100 * m['mfu']:.1f}%"]
    if "expert_imbalance" in m:
        parts.append(f"imbalance {m['expert_imbalance']:.2f}")
    if m.get("skipped"):
        parts.append(f"SKIPPED (loss scale {m['loss_scale']:.0f})")
    return " | ".join(parts)


def read_run_config(run_dir: Path) -> JobConfig:
    from seektrain.config.loader import load_config

    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ValueError(f"{path} not found: --run must name a folder made by `seektrain train`")
    return load_config(path)



def read_model_config(run_dir: Path) -> ModelConfig:
    path = Path(run_dir) / MODEL_CONFIG
    if not path.is_file():
        raise ValueError(f"{path} not found: --run must name a folder made by `seektrain train`")
    return ModelConfig.from_dict(json.loads(path.read_text()))
