"""The planner's entry points: ``plan_job`` (what ``seektrain plan`` prints) and ``best_layout``
(what ``parallel.auto`` applies), with the one-line refusals for input no layout can serve."""

from __future__ import annotations

from seektrain.config.schema import JobConfig
from seektrain.errors import UserError
from seektrain.models.config import ModelConfig
from seektrain.plan.hardware import GPUS, Hardware, hardware
from seektrain.plan.search import GIB, SearchResult, planned_precision, search

MAX_GPUS = 65536


def hardware_for(gpu: str, gpus: int, nodes: int) -> Hardware:
    if not 1 <= gpus <= MAX_GPUS:  # the search's cost grows with the count: refuse at once, not after minutes
        raise UserError(f"--gpus={gpus} must be between 1 and {MAX_GPUS}")
    if gpu.lower() == "cpu":
        nodes = nodes or 1
    else:
        nodes = nodes or -(-gpus // 8)
    if nodes < 1 or gpus % nodes:
        raise UserError(
            f"--gpus={gpus} does not split evenly over --nodes={nodes}; use a multiple of the node count"
        )
    return hardware(gpu, gpus // nodes)


def _check_batch(job: JobConfig) -> None:
    t = job.train
    if t.global_batch_size < 1 or t.seq_len < 1:
        raise UserError(
            f"global batch ({t.global_batch_size}) and sequence length ({t.seq_len}) must be >= 1"
        )


def _batch_error(job: JobConfig, result: SearchResult) -> str | None:
    """One line when every layout failed on the batch arithmetic alone."""
    if result.ranked or any(c.memory is not None for c in result.rejected):
        return None
    if result.batch_skipped:
        return (
            f"global batch {job.train.global_batch_size} sequences cannot be split over the data-parallel "
            f"sizes {result.world_size} devices allow (micro-batch 1-8 × dp × accumulation); use a multiple "
            f"of {result.world_size}"
        )
    return None


def smallest_fit(job: JobConfig, model: ModelConfig, gpu: str, gpus: int, per_node: int) -> str:
    """The smallest hardware the model fits on: more of the same device, or a bigger device at this count."""
    quick = {"checkpoint_modes": ("full",), "micro_batches": (1,)}
    n = gpus * 2
    while n <= MAX_GPUS:
        job_n = _scaled_batch(job, gpus, n)
        if search(job_n, model, n, hardware(gpu, per_node), **quick).ranked:
            return f"{n} × {gpu}"
        n *= 2
    bigger = [name for name, hw in GPUS.items() if hw.memory_gib > hardware(gpu, per_node).memory_gib]
    for name in sorted(bigger, key=lambda k: GPUS[k].memory_gib):
        if search(job, model, gpus, hardware(name, per_node), **quick).ranked:
            return f"{gpus} × {name}"
    return f"none up to {MAX_GPUS} × {gpu}"


def _scaled_batch(job: JobConfig, gpus: int, n: int) -> JobConfig:
    import copy

    job = copy.deepcopy(job)
    if job.train.global_batch_size % n:
        job.train.global_batch_size = job.train.global_batch_size * n // gpus
    return job


def gpu_counts(limit: int = MAX_GPUS):
    """The device counts ``fewest_gpus`` tries, ascending: 1, 2, 4, one node of 8, then whole nodes."""
    yield from (1, 2, 4)
    n = 8
    while n <= limit:
        yield n
        n += 8


def fewest_gpus(job: JobConfig, model: ModelConfig, gpu: str, per_device_batch: int = 0) -> int:
    """The smallest device count with a feasible layout (CPU offload allowed) for ``job`` on ``gpu``;
    ``per_device_batch``: the global batch follows the count (``--model`` without ``--global-batch``),
    else the job's stays. Each count is probed with the least memory a layout can take (full activation
    checkpointing, micro-batch 1); the caller then plans the count it returns in full."""
    import copy

    _check_batch(job)
    quick = {"checkpoint_modes": ("full",), "micro_batches": (1,)}
    for n in gpu_counts():
        job_n = job
        if per_device_batch:
            job_n = copy.deepcopy(job)
            job_n.train.global_batch_size = per_device_batch * n
        if search(job_n, model, n, hardware_for(gpu, n, 0), **quick).ranked:
            return n
    raise UserError(f"model {model.name} fits no layout on up to {MAX_GPUS} × {gpu}, CPU offload included")


def best_feasible(job: JobConfig, model: ModelConfig, gpus: int, hw: Hardware, **kw) -> SearchResult:
    """The search, or a ValueError of one line when nothing can run."""
    _check_batch(job)
    result = search(job, model, gpus, hw, **kw)
    if result.ranked:
        return result
    error = _batch_error(job, result)
    if error:
        raise UserError(error)
    fit = [c.memory for c in result.rejected if c.memory is not None]
    if not fit:
        reasons = [c.reason for c in result.rejected]
        common = max(set(reasons), key=reasons.count) if reasons else "no layout to try"
        raise UserError(f"model {model.name} cannot be laid out on {gpus} × {hw.name}: {common}")
    need = min(m.total for m in fit) / GIB
    where = smallest_fit(job, model, hw.name, gpus, hw.gpus_per_node) if hw.name != "cpu" else "more memory"
    raise UserError(
        f"model {model.name} fits no layout on {gpus} × {hw.name}: the smallest layout needs "
        f"{need:.1f} GiB per rank of {hw.memory_gib:.1f} GiB; it fits on {where}"
    )


def plan_job(job: JobConfig, model: ModelConfig, gpus: int, gpu: str, nodes: int = 0, top: int = 5) -> dict:
    """Search and summarise (the dict ``seektrain plan --json`` prints)."""
    from seektrain.models.param_count import count_params
    from seektrain.plan.report import to_dict

    hw = hardware_for(gpu, gpus, nodes)
    result = best_feasible(job, model, gpus, hw)
    dtype = planned_precision(job, hw).name
    precision = f"{dtype} compute, fp32 master weights and AdamW"
    if job.lora.enabled:
        precision = (
            f"LoRA r={job.lora.rank} on {', '.join(job.lora.target_modules)}: frozen {dtype} base, "
            f"fp32 adapters with AdamW"
        )
    counts = count_params(model)
    header = {
        "model": model.name,
        "params_total": counts.total,
        "params_active": counts.active,
        "gpus": gpus,
        "nodes": gpus // hw.gpus_per_node,
        "seq_len": job.train.seq_len,
        "global_batch": job.train.global_batch_size,
        "precision": precision,
    }
    return to_dict(result, header, top)
