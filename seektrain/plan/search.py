"""Enumerate the layouts a job could run with on given hardware, resolve each through ``RunPlan.resolve``
(whose ``ConfigError`` is the reason a layout cannot work), drop those that do not fit in memory, and rank
the rest by predicted step time."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from seektrain.config.loader import ConfigError
from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.models.hf_slice_reader import PEAK_BUFFER_BYTES
from seektrain.models.registry import family_for
from seektrain.plan import memory
from seektrain.plan.hardware import Hardware
from seektrain.plan.run_plan import RunPlan
from seektrain.plan.speed import StepTime, step_time
from seektrain.platform.compute_dtype import DtypeChoice, choose_dtype

GIB = 2**30
CHECKPOINT_MODES = ("none", "selective", "every:2", "full")
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: memory.Activations
    comm_buffers: float  # gathered parameters (FSDP) or autocast's low-precision copies
    allowance: float  # CUDA context + fragmentation
    host_state: float = 0.0  # parallel.cpu_offload: parameters, gradients and AdamW state in host memory
    frozen: float = 0.0  # lora.enabled: the frozen base in the compute dtype
    host_staging: float = 0.0  # checkpoint.async_save: the host snapshot of what a checkpoint saves
    host_load: float = 0.0  # model.hf_path: the loader's buffers while each rank reads its slices

    @property
    def host_total(self) -> float:
        """Host memory this rank needs beyond the process itself (pinned on a GPU)."""
        return self.host_state + self.host_staging

    @property
    def total(self) -> float:
        return (
            self.frozen
            + self.params
            + self.grads
            + self.optimizer
            + self.activations.total
            + self.comm_buffers
            + self.allowance
        )

    def items(self) -> dict[str, float]:
        a = self.activations
        host = {"host memory (cpu_offload)": self.host_state} if self.host_state else {}
        if self.host_staging:
            host["host memory (async checkpoint staging)"] = self.host_staging
        frozen = {"frozen base (compute dtype, LoRA)": self.frozen} if self.frozen else {}
        ring = {"context-parallel ring (chunks, blocks)": a.cp_ring} if a.cp_ring else {}
        return {
            **frozen,
            "parameters (fp32 master)": self.params,
            "gradients (fp32)": self.grads,
            "optimizer (AdamW fp32 moments)": self.optimizer,
            f"activations ({a.in_flight} micro-batch(es) in flight)": a.layers,
            "backward working set": a.backward,
            "checkpoint recompute": a.recompute,
            "logits / loss and MTP": a.head,
            "MoE dispatch buffers": a.moe_dispatch,
            **ring,
            "communication buffers": self.comm_buffers,
            "CUDA context + fragmentation": self.allowance,
            "total": self.total,
            **host,
        }


@dataclass
class Candidate:
    settings: dict[str, object]  # the config keys this layout sets
    plan: RunPlan | None = None
    reason: str = ""  # why it cannot run ("" = feasible)
    memory: MemoryBreakdown | None = None
    time: StepTime | None = None

    @property
    def feasible(self) -> bool:
        return not self.reason


@dataclass
class SearchResult:
    hardware: Hardware
    world_size: int
    ranked: list[Candidate]  # feasible, fastest first
    rejected: list[Candidate] = field(default_factory=list)
    batch_skipped: int = 0  # layouts whose data-parallel size does not divide the global batch


def memory_breakdown(plan: RunPlan, hw: Hardware) -> MemoryBreakdown:
    state = _state(plan)
    comm_buffers = _per_layout(memory.comm_buffer_bytes, plan)
    # pipeline: the first rank holds the most micro-batches, the last the head; take the larger
    ranks = (0, plan.pp - 1) if plan.pp > 1 else (0,)
    acts, _, peak = max(
        (memory.transient_bytes(plan, hw.name == "cpu", comm_buffers, r) for r in ranks), key=lambda t: t[2]
    )
    comm = peak - acts.total  # what the buffers add to the activations' own peak
    host = 0.0
    frozen, params, grads, optimizer = state.frozen, state.params, state.grads, state.optimizer
    if offloads(plan):  # FSDP2's CPUOffloadPolicy: the sharded state (a frozen base too) lives on the host
        host, frozen, params, grads, optimizer = frozen + params + grads + optimizer, 0, 0, 0, 0
    tensors = frozen + params + grads + optimizer + peak
    allowance = hw.context_gib * GIB + memory.FRAGMENTATION * tensors
    # an async save snapshots what a checkpoint holds (a LoRA checkpoint: the adapters, not the base)
    staging = state.params + state.optimizer if plan.job.checkpoint.async_save else 0
    # model.hf_path: each rank reads its own slices straight into its shards (already counted above),
    # through the loader's bounded buffers (models/hf_slice_reader.py)
    load = PEAK_BUFFER_BYTES if plan.job.model.hf_path else 0
    return MemoryBreakdown(params, grads, optimizer, acts, comm, allowance, host, frozen, staging, load)


def offloads(plan: RunPlan) -> bool:
    """``parallel.cpu_offload``: FSDP2's CPUOffloadPolicy (FSDP runs even over one rank then)."""
    return plan.cpu_offload and plan.uses_fsdp


_LAYOUT_CACHE: dict[tuple, object] = {}


def _per_layout(fn, plan: RunPlan):
    """``fn(plan)`` once per distinct layout: state and communication buffers depend on the degrees, the
    pipeline split and the dtype, not on the batch or checkpointing."""
    p = plan.job.parallel
    key = (
        fn.__name__,
        repr(plan.model),  # a dataclass's repr names every field (to_dict + json is 30x slower)
        plan.tp,
        plan.pp,
        plan.ep,
        plan.cp,
        plan.dp_shard,
        plan.dp_replicate,
        plan.uses_fsdp,
        p.pp_schedule,
        p.pp_stages_per_rank,
        plan.pp_stage_layers,
        plan.precision.name,
        plan.lora,
    )
    if key not in _LAYOUT_CACHE:
        _LAYOUT_CACHE[key] = fn(plan)
    return _LAYOUT_CACHE[key]


def _state(plan: RunPlan) -> memory.StateBytes:
    return _per_layout(memory.max_state_bytes, plan)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


# Context parallelism is tried while each rank keeps at least this many tokens of a sequence: below it the
# ring's per-step messages and attention blocks get small enough for latency, which this bandwidth model
# does not see, to decide (and sequences of 4096 or less keep cp=1).
MIN_CP_TOKENS = 4096


def cp_degrees(world: int, seq_len: int) -> list[int]:
    """Context-parallel degrees to try: powers of two dividing the world that cut the sequence into
    ``2·cp`` equal chunks of a pair of at least ``MIN_CP_TOKENS`` tokens per rank."""
    return [
        c
        for c in _powers_of_two(world)
        if world % c == 0 and seq_len % (2 * c) == 0 and (c == 1 or seq_len // c >= MIN_CP_TOKENS)
    ]


def layouts(
    model: ModelConfig,
    world: int,
    gpus_per_node: int,
    global_batch: int,
    seq_len: int,
    checkpoint_modes=CHECKPOINT_MODES,
    micro_batches=MICRO_BATCHES,
    offload_modes=None,
):
    """Candidate settings (None for a layout whose data-parallel size does not divide the global batch,
    so the caller can tell that apart): tp within a node; cp over the sequence (``cp_degrees``);
    ``parallel.cpu_offload`` off and on (``offload_modes``: the values to try; ``(None,)`` leaves the key
    out); pp up to the layer count; dp_replicate so that a shard group (``dp_shard × cp × tp`` ranks)
    spans 1, 2, 4, ... nodes (or everything); ep over the experts, whole tp and cp groups times a
    divisor of ``dp_shard`` (cp × tp × ep together too: ``ep = cp·tp·k``); micro-batch;
    checkpointing."""
    if offload_modes is None:
        offload_modes = (False, True)
    experts = family_for(model).costs.routed_experts(model)  # the units an ep group splits
    for tp in [t for t in _powers_of_two(min(gpus_per_node, 8)) if world % t == 0]:
        for cp in cp_degrees(world // tp, seq_len):
            for pp in [p for p in _divisors(world // (tp * cp)) if p <= model.num_hidden_layers and p <= 16]:
                dp = world // (tp * cp * pp)
                per_node = max(1, gpus_per_node // (tp * cp))
                shard_sizes = {dp} | {s for s in (per_node * k for k in _powers_of_two(dp)) if dp % s == 0}
                for dp_shard in sorted(shard_sizes):
                    eps = [1]
                    if model.is_moe:
                        unit = tp * cp  # an ep group takes whole tp and cp groups
                        eps += [
                            unit * k
                            for k in _powers_of_two(dp_shard)
                            if unit * k > 1 and experts % (unit * k) == 0
                        ]
                    for ep in eps:
                        for micro in micro_batches:
                            if global_batch % (micro * dp):
                                yield None  # the global batch does not split over this data-parallel size
                                continue
                            for ckpt in checkpoint_modes:
                                for offload in offload_modes:
                                    settings = {
                                        "parallel.tp": tp,
                                        "parallel.pp": pp,
                                        "parallel.dp_replicate": dp // dp_shard,
                                        "parallel.dp_shard": dp_shard,
                                        "parallel.cp": cp,
                                        "parallel.ep": ep,
                                        "train.micro_batch_size": micro,
                                        "train.activation_checkpoint": ckpt,
                                    }
                                    if offload_modes != (None,):
                                        settings["parallel.cpu_offload"] = offload
                                    yield settings


def apply_settings(job: JobConfig, settings: dict[str, object]) -> JobConfig:
    """A copy of ``job`` with ``settings`` (``section.key: value``). A changed pipeline degree drops a
    manual ``pp_split`` and ``pp_microbatches``, which were for the old one."""
    job = copy.deepcopy(job)
    if settings.get("parallel.pp", job.parallel.pp) != job.parallel.pp:
        job.parallel.pp_split, job.parallel.pp_microbatches = [], 0
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(job, section), name, value)
    return job


def planned_precision(job: JobConfig, hw: Hardware) -> DtypeChoice:
    """The compute dtype on the hardware planned for: a CPU is this machine's, which decides itself;
    every GPU in ``plan.hardware.GPUS`` (A100 and newer) has bf16 tensor cores, so ``auto`` is bf16."""
    if hw.name == "cpu" or job.precision.dtype != "auto":
        return choose_dtype(job.precision.dtype, "cpu")
    return DtypeChoice("bf16", f"precision.dtype=auto -> bf16: {hw.name} has bf16 tensor cores")


def evaluate(job: JobConfig, model: ModelConfig, world: int, hw: Hardware, settings: dict) -> Candidate:
    cand = Candidate(settings)
    try:
        cand.plan = RunPlan.resolve(
            apply_settings(job, settings),
            model,
            world,
            "cpu" if hw.name == "cpu" else "cuda",
            planned_precision(job, hw),
        )
    except ConfigError as err:
        cand.reason = str(err)
        return cand
    cand.memory = memory_breakdown(cand.plan, hw)
    # on --gpu cpu the host is the device (host_gib 0): there is nothing to offload to, and staging is host
    # memory like the rest
    host = cand.memory.host_total if hw.host_gib else cand.memory.host_state
    if host > hw.host_gib * GIB:
        what = "cpu_offload" if cand.memory.host_state else "checkpoint.async_save staging"
        cand.reason = f"{what}: does not fit in {hw.host_gib:.0f} GiB of host memory per device"
        return cand
    if cand.memory.total > hw.memory_gib * GIB:
        cand.reason = (
            f"does not fit in {hw.memory_gib:.1f} GiB per rank (needs {cand.memory.total / GIB:.1f} GiB)"
        )
        return cand
    cand.time = step_time(cand.plan, hw, _state(cand.plan))
    return cand


def _speed_order(cand: Candidate) -> tuple[float, int, float]:
    assert cand.time is not None and cand.plan is not None and cand.memory is not None  # a feasible one
    return round(cand.time.total_s, 9), cand.plan.accum_steps, cand.memory.total


def search(job: JobConfig, model: ModelConfig, world: int, hw: Hardware, **layout_kw) -> SearchResult:
    """Every candidate layout of ``job`` for ``world`` ranks on ``hw``; feasible ones ranked fastest first."""
    if hw.name == "cpu":  # the host is the device: nothing to offload to
        layout_kw.setdefault("offload_modes", (False,))
    ranked: list[Candidate] = []
    rejected: list[Candidate] = []
    skipped = 0
    batch, seq = job.train.global_batch_size, job.train.seq_len
    for settings in layouts(model, world, hw.gpus_per_node, batch, seq, **layout_kw):
        if settings is None:
            skipped += 1
            continue
        cand = evaluate(job, model, world, hw, settings)
        (ranked if cand.feasible else rejected).append(cand)
    # ties (e.g. micro-batch sizes whose difference the roofline cannot see): fewer, larger micro-batches
    # first, since small matmuls run below the stated efficiency; then less memory
    ranked.sort(key=_speed_order)
    return SearchResult(hw, world, ranked, rejected, skipped)
