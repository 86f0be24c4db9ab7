"""Activation checkpointing of decoder layers: none, every layer ("full"), every K-th ("every:K"), or
every layer op by op ("selective").

A fully checkpointed layer keeps only its input and recomputes the rest during backward: about one extra
forward of compute for a large cut in activation memory. A selectively checkpointed layer keeps the
outputs of the operations that are expensive to redo — matrix multiplies (dense, batched, grouped, FP8)
and attention — and recomputes only the cheap, memory-bound rest (norms, RoPE, activations, elementwise
products, casts, routing arithmetic) from them: almost no extra FLOPs, and activation memory between
"none" and "full" (torchtitan's op-level selective checkpointing; the planner's model of what stays is in
``seektrain/plan/memory.py``).

Functional collectives inside a layer (tensor parallelism's sequence all-gathers and reduce-scatters,
which DTensor issues; expert parallelism's all-to-alls, seektrain/parallel/expert_parallel.py) are kept
too, so recomputation never communicates again. (A collective that fills a buffer in place, such as
``dist.all_to_all_single``, could not be kept: recomputation would leave its buffer empty.)

The zero-bubble V pipeline schedule runs a stage's backward in two passes, each recomputing; a selective
checkpoint hands its kept tensors to one recomputation only, so the run plan refuses that combination
(seektrain/plan/layout_checks.py).

No RNG state is kept for recomputation (``preserve_rng_state=False``): the models have no dropout or other
random operation in a layer, so a recomputed layer is the same computation without it. The one
exception is LoRA's adapter dropout (``lora.dropout > 0``): then the RNG state is kept, so the
recomputed layer draws the masks of its forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from seektrain.plan.recompute import SELECTIVE, checkpoint_every

# Operators whose outputs a selective checkpoint keeps (``namespace.op.overload``). Those a torch build
# lacks are skipped, so the list can name every variant PyTorch 2.11+ dispatches to.
SAVED_OPS = (
    # matrix multiplies: nn.Linear (mm / addmm), batched and grouped expert GEMMs, FP8 GEMMs
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_mm.default",
    "aten._grouped_mm.default",
    "aten._scaled_grouped_mm.default",
    # F.scaled_dot_product_attention's kernels: their output and log-sum-exp
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_attention_math.default",
    # FP8 scaling (precision.fp8: torchao's absmax of each cast tensor; a scalar or a row's worth), kept as
    # torchtitan does so that recomputation does not reduce over the whole tensor again
    "aten.max.default",
    "aten.amax.default",
    # functional collectives (DTensor's redistributions under TP/SP, expert parallelism's all-to-alls)
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional_autograd.all_gather_into_tensor.default",
    "_c10d_functional_autograd.reduce_scatter_tensor.default",
    "_c10d_functional_autograd.all_to_all_single.default",
)


def _resolve(name: str):
    namespace, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def saved_ops() -> frozenset:
    """The ``OpOverload``s of ``SAVED_OPS`` this torch has."""
    return frozenset(op for op in map(_resolve, SAVED_OPS) if op is not None)


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of ``saved_ops()``; recompute everything else. ``MUST_SAVE`` so that
    ``torch.compile``'s partitioner keeps them too; ``PREFER_RECOMPUTE`` leaves it free to save a cheap op
    it would rather not redo."""
    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint``: a fresh pair of caching contexts per call."""
    return create_selective_checkpoint_contexts(selective_policy)


def ignore_profiler_ops() -> None:
    """Leave the profiler's record-function operators out of selective checkpointing's replay.

    Selective checkpointing replays a layer's forward by counting every operator call. FSDP2 opens a
    ``record_function`` range (dispatched as ``torch.ops.profiler._record_function_*``) in its forward hooks,
    and under expert parallelism the experts are an FSDP module of their own inside the layer, whose hooks
    open one more range during recomputation than during the forward: the replay then fails with
    "profiler._record_function_enter_new.default invocation index N encountered during backward but not
    found in storage" (pytorch/torchtitan#3427). These operators carry no tensor to save, so torch's public
    ``SAC_IGNORED_OPS`` (operators selective checkpointing runs without counting) is where they belong, as
    the pending upstream fix puts them."""
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        for overload in packet.overloads() if packet is not None else ():
            torch_checkpoint.SAC_IGNORED_OPS.add(getattr(packet, overload))


def apply_activation_checkpointing(model: nn.Module, mode: str, preserve_rng_state: bool = False) -> int:
    """Wrap layers in place; returns how many were wrapped. ``preserve_rng_state``: the layers draw random
    numbers (LoRA's adapter dropout)."""
    every = checkpoint_every(mode)
    if not every:
        return 0
    extra: dict[str, Any] = {}  # keyword arguments of torch.utils.checkpoint.checkpoint
    if mode == SELECTIVE:
        ignore_profiler_ops()
        extra["context_fn"] = selective_contexts
    wrapped = 0
    layers = model.layers
    assert isinstance(layers, nn.ModuleDict), "a family model keeps its decoder layers in a ModuleDict"
    for key, layer in list(layers.items()):
        if int(key) % every == 0:
            layers[key] = checkpoint_wrapper(layer, preserve_rng_state=preserve_rng_state, **extra)
            wrapped += 1
    return wrapped
