"""Every check of a parallel layout, against the world size and against the model, in one place.

Each returns or raises one line naming the setting and the fix. They run once, when a ``RunPlan`` is
resolved (in the launcher, before any worker starts, and again in each worker); the parallel functions
that apply a layout trust the plan and check nothing.
"""

from __future__ import annotations

from seektrain.config.loader import ConfigError
from seektrain.config.schema import ParallelSection
from seektrain.models.config import ModelConfig
from seektrain.models.registry import family_for
from seektrain.plan.pipeline_split import MULTI_STAGE, split_layers, stages_per_rank


def ep_layout_error(ep: int, dp_shard: int, tp: int, cp: int = 1) -> str | None:
    """Why ``ep`` expert-parallel ranks do not fit the layout (one line), or None.

    Without tensor parallelism the ep ranks are data-parallel shard ranks, so ``ep`` must divide
    ``dp_shard``. With it, an ep group takes whole tensor-parallel groups (each tp rank dispatches its
    own share of the tokens, torchtitan's "ETP=1"): ``ep = tp × k`` with ``k`` dividing ``dp_shard``.
    With context parallelism an ep group takes whole context-parallel groups too, as torchtitan's
    does (each cp rank routes its own chunks): ``ep = cp × tp × k``, the ep group being the ranks
    ``(dp_shard_in_ep = k, cp, tp)`` of the world mesh (``parallel.mesh._expert_meshes``); e.g. cp=2 ×
    tp=2 × ep=4 on 4 ranks, each tp rank of each cp rank dispatching its share of its own chunks.
    """
    if ep < 1:
        return f"parallel.ep={ep} must be >= 1"
    if ep == 1:
        return None
    if cp > 1:
        unit = cp * tp
        if ep % unit or dp_shard % (ep // unit):
            return (
                f"parallel.ep={ep} must be parallel.cp × tp = {cp}×{tp} = {unit} times a divisor of "
                f"parallel.dp_shard={dp_shard}: expert parallelism borrows whole context-parallel groups"
            )
        return None
    if tp == 1:
        if dp_shard % ep:
            return (
                f"parallel.ep={ep} must divide parallel.dp_shard={dp_shard}: experts are spread over the "
                "data-parallel shard ranks"
            )
        return None
    if ep % tp:
        return (
            f"parallel.ep={ep} must be a multiple of parallel.tp={tp}: expert parallelism borrows every "
            f"tensor-parallel rank; set parallel.ep to tp × a divisor of parallel.dp_shard={dp_shard}"
        )
    if dp_shard % (ep // tp):
        return (
            f"parallel.ep={ep} must divide parallel.dp_shard × tp = {dp_shard}×{tp} = {dp_shard * tp}: "
            f"set parallel.ep to tp × a divisor of parallel.dp_shard"
        )
    return None


def check_degrees(
    world_size: int,
    pp: int,
    dp_replicate: int,
    dp_shard: int,
    tp: int,
    ep: int,
    data_parallel: str,
    cp: int = 1,
) -> None:
    """The degrees multiply to the world size and compose (model-independent)."""
    product = pp * dp_replicate * dp_shard * cp * tp
    if product != world_size:
        named = "dp_shard × cp × tp" if cp > 1 else "dp_shard × tp"
        sizes = f"{dp_shard}×{cp}×{tp}" if cp > 1 else f"{dp_shard}×{tp}"
        raise ConfigError(
            f"parallel.pp × dp_replicate × {named} = {pp}×{dp_replicate}×{sizes} = {product} but the "
            f"world size is {world_size}; set parallel.dp_shard=-1 or fix the degrees"
        )
    error = ep_layout_error(ep, dp_shard, tp, cp)
    if error:
        raise ConfigError(error)
    dp = dp_replicate * dp_shard
    if ep > 1 and data_parallel == "ddp" and dp > 1:
        raise ConfigError(
            f"parallel.ep={ep} needs parallel.data_parallel=fsdp: DDP cannot hold expert shards"
        )
    if data_parallel == "ddp" and dp_shard > 1:
        raise ConfigError(
            "parallel.data_parallel=ddp replicates the model: set parallel.dp_shard=1 and "
            "parallel.dp_replicate to the data-parallel size, or use data_parallel=fsdp"
        )
    if pp > 1 and data_parallel == "ddp" and dp > 1:
        raise ConfigError("parallel.pp > 1 composes with data_parallel=fsdp; set parallel.data_parallel=fsdp")


def check_context_parallel(job, cfg: ModelConfig, cp: int) -> None:
    """``parallel.cp`` splits each sequence into ``2·cp`` equal chunks (two per rank, load-balanced) and
    runs attention as a ring over them (seektrain/parallel/context_parallel.py). It composes with every
    other dimension (which ranks expert parallelism then draws from: ``ep_layout_error``); what is
    checked here is that the sequence splits into the chunks and sequence shards it needs."""
    if cp == 1:
        return
    p, seq = job.parallel, job.train.seq_len
    if cp < 1:
        raise ConfigError(f"parallel.cp={cp} must be >= 1")
    if seq % (2 * cp):
        raise ConfigError(
            f"train.seq_len={seq} does not split into 2 × parallel.cp = {2 * cp} equal chunks (each "
            f"context-parallel rank holds two); set train.seq_len to a multiple of {2 * cp}"
        )
    if p.tp > 1 and seq // cp % p.tp:
        raise ConfigError(
            f"train.seq_len / parallel.cp = {seq // cp} tokens per rank do not split over parallel.tp="
            f"{p.tp} sequence shards; set train.seq_len to a multiple of {2 * cp * p.tp}"
        )


def check_cpu_offload(cpu_offload: bool, data_parallel: str) -> None:
    """CPU offload is FSDP2's ``CPUOffloadPolicy``: DDP (which keeps whole parameters on the device) has none."""
    if cpu_offload and data_parallel != "fsdp":
        raise ConfigError(
            f"parallel.cpu_offload needs parallel.data_parallel=fsdp (it is FSDP's CPU offload), "
            f"not {data_parallel}; set parallel.data_parallel=fsdp or parallel.cpu_offload=false"
        )


def check_float8(recipe: str, tp: int) -> None:
    """``precision.fp8`` layouts torchao can run: rowwise float8 linears take tensor-parallel (DTensor)
    weights; torchao's blockwise layer runs its triton kernels on plain tensors only."""
    if recipe == "blockwise" and tp > 1:
        raise ConfigError(
            f"precision.fp8=blockwise cannot run under parallel.tp={tp}: torchao's blockwise FP8 "
            "layer takes no tensor-parallel weights; set parallel.tp=1 (FSDP/EP/PP are fine) "
            "or precision.fp8=rowwise"
        )


_TP_UNITS: dict[str, list[tuple[str, int]]] = {}


def _tp_units(cfg: ModelConfig) -> list[tuple[str, int]]:
    """Every (unit, count) TP splits, heads first; cached per config (its ``repr``) for the planner."""
    key = repr(cfg)
    if key not in _TP_UNITS:
        units = [w.tp_unit for w in family_for(cfg).weights(cfg).values() if w.tp_unit]
        # the heads first: a tp that splits no whole head is the mistake users make (and the one to name)
        units.sort(key=lambda unit: not unit[0].endswith("heads"))
        _TP_UNITS[key] = units
    return _TP_UNITS[key]


def tp_error(cfg: ModelConfig, tp: int) -> str | None:
    """Why the model's sharded dimensions do not divide by ``tp`` (one line), or None: each weight TP
    splits (``models/deepseek/shapes.py``) is cut into whole pieces of its ``tp_unit`` (heads, the vocabulary, MLP
    features, experts), so ``tp`` must divide every unit count."""
    if tp == 1:
        return None
    for what, size in _tp_units(cfg):
        if size % tp:
            return f"parallel.tp={tp} does not divide {what}={size} of model {cfg.name!r}: choose a tp that divides it"
    return None


def ep_model_error(cfg: ModelConfig, ep: int) -> str | None:
    """Why the model cannot split its experts over ``ep`` ranks (one line), or None."""
    if ep == 1:
        return None
    if not cfg.is_moe:
        return f"parallel.ep={ep} needs a MoE model but {cfg.name!r} is dense: set parallel.ep=1"
    experts = family_for(cfg).costs.routed_experts(cfg)
    if experts % ep:
        return (
            f"parallel.ep={ep} does not divide the {experts} routed experts of {cfg.name!r}: "
            f"choose a divisor of {experts}"
        )
    return None


def check_model(cfg: ModelConfig, tp: int, ep: int, dp_shard: int, cp: int = 1) -> None:
    error = tp_error(cfg, tp) or ep_layout_error(ep, dp_shard, tp, cp) or ep_model_error(cfg, ep)
    if error:
        raise ConfigError(error)


def pipeline_microbatches(n: int, local_sequences: int) -> int:
    """Micro-batches per pipeline step; the step's sequences on one rank must split evenly into them."""
    if n < 1 or local_sequences % n:
        raise ConfigError(
            f"parallel.pp_microbatches={n} does not divide the {local_sequences} sequences each "
            "data-parallel rank gets per step; pick a divisor"
        )
    return n


def check_pipeline_checkpointing(activation_checkpoint: str, p: ParallelSection) -> None:
    """The zero-bubble V schedule runs a stage's backward in two passes (input gradients, then weight
    gradients), each recomputing the checkpointed layers; a selective checkpoint hands its kept tensors to
    one recomputation only (torch raises "Trying to backward an extra time")."""
    if activation_checkpoint == "selective" and p.pp > 1 and p.pp_schedule == "zbv":
        raise ConfigError(
            "train.activation_checkpoint=selective cannot run under parallel.pp_schedule=zbv (its "
            "split backward recomputes each layer twice, a selective checkpoint allows once): use "
            "train.activation_checkpoint=full or another parallel.pp_schedule"
        )


def check_pipeline(
    cfg: ModelConfig, p: ParallelSection, n_micro: int, dp: int
) -> tuple[tuple[int, ...], ...]:
    """The layer ranges of every stage, after checking the schedule, split and micro-batch count."""
    per_rank = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
    stages = split_layers(cfg, p.pp * per_rank, p.pp_split or None)
    if p.pp_schedule == "1f1b" and n_micro < p.pp:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs at least parallel.pp={p.pp} micro-batches per step "
            f"but gets {n_micro}; set parallel.pp_microbatches or raise train.global_batch_size"
        )
    if p.pp_schedule in MULTI_STAGE and n_micro % p.pp:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule} needs the number of pipeline micro-batches "
            f"({n_micro}) to be a multiple of parallel.pp={p.pp}"
        )
    return tuple(tuple(s) for s in stages)
