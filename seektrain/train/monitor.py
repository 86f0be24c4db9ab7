"""What a run reports while it trains: per-step metrics to every sink (JSONL, TensorBoard, Prometheus,
experiment trackers), the console line and progress bar, the profiler window, and ``summary.json`` at
the end. The trainer calls it around each step (``before_step``, ``after_step``: host-side facts taken
when the step ends) and ``seektrain.train.step_log`` hands it each step's metrics at a flush (``log``);
neither knows anything of the outlets."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from seektrain.config.loader import config_to_dict
from seektrain.observe.flops import MfuMeter, model_flops_per_token, model_matmul_shapes, peak_flops
from seektrain.observe.memory_stats import GpuStats, memory_stats
from seektrain.observe.sink import MetricsSink
from seektrain.observe.summary import format_summary, write_summary
from seektrain.parallel.expert_parallel import all_to_all_calls
from seektrain.parallel.ring_attention import ring_hops
from seektrain.train.progress import Progress

log = logging.getLogger("seektrain.train")


class RunMonitor:
    def __init__(
        self,
        plan,
        run_dir: Path,
        rank: int,
        local_rank: int,
        device: torch.device,
        start_step: int,
        resumed: bool,
    ):
        job = plan.job
        self.plan, self.run_dir, self.rank, self.device = plan, run_dir, rank, device
        self.flops_per_token = model_flops_per_token(plan.model, job.train.seq_len)
        shapes = model_matmul_shapes(plan.model, job.train.micro_batch_size * job.train.seq_len)
        self.mfu = MfuMeter(*peak_flops(device, plan.compute_dtype, shapes=shapes), self.flops_per_token)
        m = job.metrics
        self.sink = MetricsSink(
            run_dir,
            rank=rank,
            prometheus_port=m.prometheus_port,
            prometheus_host=m.prometheus_host,
            all_ranks_serve=m.all_ranks,
            local_rank=local_rank,
            tensorboard=m.tensorboard,
            trackers=m.trackers,
            tracker_project=m.tracker_project,
            run_name=job.run.name,
            mlflow_tracking_uri=m.mlflow_tracking_uri,
            params=config_to_dict(job),
            resume=resumed,
        )
        self.sink.set_run_info(
            run=job.run.name or run_dir.name, model=plan.model.name, world_size=plan.world_size
        )
        self.profiler = None
        if job.profile.steps and rank == 0:
            from seektrain.observe.profiler import StepProfiler

            self.profiler = StepProfiler(run_dir, job.profile.steps)
        self.progress = Progress(start_step, job.train.steps, enabled=rank == 0 and job.run.progress_bar)
        # NVML started once; sampled every metrics.gpu_stats_interval steps, not every step
        self.gpu = GpuStats(device.index) if device.type == "cuda" else None
        self.gpu_interval = m.gpu_stats_interval
        self.start_step = start_step
        self.records: list[dict] = []
        self._ended: dict[int, float] = {}  # step -> wall-clock time it ended, until it is logged
        self._all_to_all_at_start = 0
        self.all_to_all_per_step: list[int] = []  # expert-parallel all-to-alls issued in each step
        self._hops_at_start = 0
        self.cp_hops_per_step: list[int] = []  # context-parallel ring hops issued in each step

    def before_step(self, step: int) -> None:
        self._all_to_all_at_start = all_to_all_calls()
        self._hops_at_start = ring_hops()
        if self.profiler:
            self.profiler.before_step(step)

    def after_step(self, step: int, values: dict) -> None:
        """When a step ends (its values may still be on the device): close the profiler's step, add the
        memory numbers of this moment and, every ``metrics.gpu_stats_interval`` steps, a GPU sample
        (NVML: utilisation, power; absent when unavailable); move the progress bar."""
        if self.profiler:
            self.profiler.after_step(step)
        self._ended[step] = time.time()
        self.all_to_all_per_step.append(all_to_all_calls() - self._all_to_all_at_start)
        self.cp_hops_per_step.append(ring_hops() - self._hops_at_start)
        values.update(memory_stats(self.device))
        if self.gpu is not None and step % self.gpu_interval == 0:
            values.update(self.gpu.sample())
        self.progress.advance(step)

    def log(self, step: int, metrics: dict) -> None:
        """A step's metrics, read on the host (at a flush): to every sink, the records and the console."""
        metrics["tokens_per_s"] = self.plan.tokens_per_step / metrics["step_time_s"]
        metrics["mfu"] = self.mfu(step, metrics["tokens_per_s"] / self.plan.world_size)
        self.sink.log(step, metrics, wall_time=self._ended.pop(step, None))
        self.records.append({"step": step, **metrics})
        self.progress.show(metrics)
        if step % self.plan.job.run.log_interval == 0 or step == self.start_step + 1:
            self.progress.write(_format_line(step, self.plan.job.train.steps, metrics))

    def close(self) -> None:
        self.progress.close()
        self.sink.close()
        if self.gpu is not None:
            self.gpu.close()

    def summarise(self, wall_s: float, param_elements_rank0: int, layout_ran: dict) -> dict:
        """Write ``summary.json`` (rank 0) and log its lines; {} elsewhere or when no step ran.
        ``layout_ran``: what this rank trained (seektrain/parallel/layout_record.py); the all-to-alls per
        step are added to it, the fewest of any step (the first pipeline step also runs shape inference,
        an evaluation step its forward)."""
        if self.rank != 0 or not self.records:
            return {}
        layout_ran = {
            **layout_ran,
            "all_to_all_per_step": min(self.all_to_all_per_step, default=0),
            "cp_hops_per_step": min(self.cp_hops_per_step, default=0),
        }
        summary = write_summary(
            self.run_dir,
            self.records,
            {
                "wall_time_s": wall_s,
                "device_flops_peak": self.mfu.peak,
                "device_flops_source": self.mfu.source,
                "flops_per_token": self.flops_per_token,
                "world_size": self.plan.world_size,
                "layout": self.plan.describe(),
                "model": self.plan.model.name,
                "tokens_per_step": self.plan.tokens_per_step,
                "param_elements_rank0": param_elements_rank0,
                "device": str(self.device),
                "layout_ran": layout_ran,
            },
        )
        log.info("%s", format_summary(summary))
        return summary


def _format_line(step: int, total: int, m: dict) -> str:
    parts = [
        f"step {step}/{total}",
        f"loss {m['loss']:.4f}",
        f"lr {m['lr']:.2e}",
        f"grad_norm {m['grad_norm']:.3f}",
        f"tok/s {m['tokens_per_s']:.0f}",
        f"mfu {100 * m['mfu']:.1f}%",
    ]
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
    if "expert_imbalance" in m:
        parts.append(f"imbalance {m['expert_imbalance']:.2f}")
    if m.get("skipped"):
        parts.append(f"SKIPPED (loss scale {m['loss_scale']:.0f})")
    return " | ".join(parts)
