"""Out of memory in a step: end the run with one line that names the cheapest fix for *this* job, not a
traceback.

Why a rule list: the first thing a user needs after an OOM is the next setting to try, and the order of
what is cheapest is well known: recomputing activations costs ~a third more compute and nothing else; a
smaller micro-batch keeps the global batch (more accumulation steps) at some speed; sharding what is
replicated costs communication; offloading to the host costs much speed; more GPUs cost money.
``cheapest_fix(plan)`` walks that order and returns the first rule that applies to the plan. A memory
model (``seektrain plan``) can replace the walk later: the trainer calls only ``cheapest_fix`` through
``out_of_memory_error``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seektrain.errors import RunFailure

# What CPU allocations say when they fail (c10's DefaultCPUAllocator; the wording changed across releases)
_CPU_ALLOC_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


class OutOfMemory(RunFailure):
    """A step ran out of memory; the message is one line naming the fix. The CLI prints it and exits 2."""


@dataclass(frozen=True)
class Fix:
    settings: tuple[str, ...]  # ``--set`` items, or empty when the fix is not a setting
    why: str

    def __str__(self) -> str:
        sets = " ".join(f"--set {s}" for s in self.settings)
        return f"{sets} ({self.why})" if sets else self.why


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's ``torch.OutOfMemoryError``, Python's ``MemoryError``, or a failed CPU allocation."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _CPU_ALLOC_FAILURES)


def _largest_proper_divisor(n: int) -> int:
    return next(d for d in range(n // 2, 0, -1) if n % d == 0)


def cheapest_fix(plan) -> Fix:
    """The first memory-saving change, in order of cost, that this ``RunPlan`` has not made yet."""
    job = plan.job
    mode = job.train.activation_checkpoint
    if mode == "none":
        return Fix(
            ("train.activation_checkpoint=full",),
            "recompute activations in backward: about a third more compute, far fewer stored activations",
        )
    if mode != "full":  # selective or every:K
        return Fix(
            ("train.activation_checkpoint=full",),
            f"recompute every layer from its input alone instead of {mode}: more compute, fewer "
            "stored activations",
        )
    if job.train.micro_batch_size > 1:
        smaller = _largest_proper_divisor(job.train.micro_batch_size)
        return Fix(
            (f"train.micro_batch_size={smaller}",),
            f"fewer sequences per forward; the global batch stays {job.train.global_batch_size} with "
            "more accumulation steps",
        )
    if plan.data_parallel == "ddp" and plan.dp > 1:
        return Fix(
            ("parallel.data_parallel=fsdp", "parallel.dp_replicate=1", f"parallel.dp_shard={plan.dp}"),
            f"shard parameters, gradients and optimizer state over the {plan.dp} data-parallel ranks "
            "instead of replicating them",
        )
    if plan.uses_fsdp and plan.dp_replicate > 1:
        return Fix(
            ("parallel.dp_replicate=1", f"parallel.dp_shard={plan.dp}"),
            f"shard over all {plan.dp} data-parallel ranks instead of {plan.dp_shard} (HSDP replicas "
            "hold copies)",
        )
    if plan.uses_fsdp and not job.parallel.reshard_after_forward:
        return Fix(("parallel.reshard_after_forward=true",), "free gathered parameters after each forward")
    if plan.device_type != "cpu" and plan.data_parallel == "fsdp" and not plan.cpu_offload:
        return Fix(
            ("parallel.cpu_offload=true",),
            "keep parameters, gradients and optimizer state in host memory (slower, fits more)",
        )
    if plan.device_type == "cpu":
        return Fix(
            (),
            "nothing cheaper is left: use a machine with more memory, a smaller model or a shorter "
            f"train.seq_len (now {job.train.seq_len})",
        )
    return Fix(
        (),
        f"nothing cheaper is left in this layout: launch on more GPUs (e.g. {2 * plan.world_size} "
        "with parallel.dp_shard=-1 shards everything twice as thin) or shorten train.seq_len "
        f"(now {job.train.seq_len})",
    )


def out_of_memory_error(err: BaseException, plan, rank: int, phase: str) -> OutOfMemory:
    """The one-line error for ``err`` (an out-of-memory error of ``rank`` during ``phase``)."""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    detail = detail.split(". ", 1)[0].rstrip(".")  # CUDA appends allocator statistics and advice
    return OutOfMemory(
        f"rank {rank} ran out of memory during {phase}: {detail[:200]}. Cheapest fix for this "
        f"job: {cheapest_fix(plan)}"
    )
