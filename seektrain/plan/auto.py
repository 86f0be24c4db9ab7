"""``parallel.auto = true``: replace the parallel degrees and micro-batch size with the planner's best
feasible layout for the actual world size and device, before the run plan is resolved.

The launcher (to refuse early) and every worker call this with the same inputs and get the same layout:
the choice depends only on the config, the model, the world size, the ranks per node and the device's
table entry (on CPU a nominal peak, not a timing probe that could differ between ranks).
"""

from __future__ import annotations

import os

from seektrain.config.schema import JobConfig
from seektrain.errors import UserError
from seektrain.models.config import ModelConfig
from seektrain.plan.hardware import KNOWN, Hardware, cpu_hardware, hardware, name_from_device
from seektrain.plan.search import MICRO_BATCHES, apply_settings


def device_hardware(device_type: str, ranks_per_node: int) -> Hardware:
    """The table entry of the device this process trains on."""
    if device_type == "cpu":
        return cpu_hardware(ranks_per_node, measure=False)
    import torch

    name = torch.cuda.get_device_name()
    key = name_from_device(name)
    if key is None:
        raise UserError(
            f"parallel.auto does not know the GPU {name!r} (known: {', '.join(KNOWN)}); set the "
            "parallel degrees yourself (seektrain plan --gpu NAME suggests them)"
        )
    return hardware(key, ranks_per_node)


def auto_layout(
    job: JobConfig, model: ModelConfig, world_size: int, device_type: str, ranks_per_node: int | None = None
) -> tuple[JobConfig, str]:
    """(the job with the best layout's degrees and micro-batch, one line saying why); the job unchanged
    and "" when ``parallel.auto`` is off. Activation checkpointing and CPU offload stay as configured."""
    if not job.parallel.auto:
        return job, ""
    _refuse_set_degrees(job)
    from seektrain.plan.planner import best_feasible

    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    hw = device_hardware(device_type, min(per_node, world_size))
    micro = tuple(sorted(set(MICRO_BATCHES) | {job.train.micro_batch_size}))
    result = best_feasible(
        job,
        model,
        world_size,
        hw,
        checkpoint_modes=(job.train.activation_checkpoint,),
        micro_batches=micro,
        offload_modes=(job.parallel.cpu_offload,),
    )
    best = result.ranked[0]
    assert best.time is not None and best.memory is not None  # a ranked (feasible) candidate
    chosen = {k: v for k, v in best.settings.items() if k not in _KEPT}
    why = (
        f"parallel.auto: {_short(chosen)} on {world_size} × "
        f"{hw.name}: predicted step {best.time.total_s:.3g} s, {best.memory.total / 2**30:.2f} GiB per rank"
    )
    if len(result.ranked) > 1:
        runner = result.ranked[1]
        assert runner.time is not None
        why += f"; runner-up {_short(runner.settings)}: {runner.time.total_s:.3g} s"
    return apply_settings(job, chosen), why


_DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")


def _refuse_set_degrees(job: JobConfig) -> None:
    """A degree set beside ``parallel.auto`` would be silently replaced: refuse it instead, naming it."""
    from seektrain.config.schema import ParallelSection

    default = ParallelSection()
    set_keys = [
        f"parallel.{k}={getattr(job.parallel, k)}"
        for k in _DEGREES
        if getattr(job.parallel, k) != getattr(default, k)
    ]
    if set_keys:
        raise UserError(
            f"parallel.auto=true chooses the parallel degrees itself, but {', '.join(set_keys)} is set too; "
            "drop it to let auto choose, or set parallel.auto=false to keep it"
        )


_KEPT = ("train.activation_checkpoint", "parallel.cpu_offload")  # auto searches with the configured values


def _short(settings: dict) -> str:
    return " ".join(f"{key.split('.')[1]}={value}" for key, value in settings.items() if key not in _KEPT)
