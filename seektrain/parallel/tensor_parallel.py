"""Tensor parallelism (TP) and sequence parallelism (SP), applied from outside to a plain ``Transformer``
over a 1-D ``tp`` DeviceMesh (torchtitan's recipe, with torch.distributed.tensor.parallel).

Plan (``seq`` is ``Shard(1)`` with sequence parallelism, else ``Replicate()``); each weight's style is
the one the shape description (``seektrain/models/deepseek/shapes.py``) gives it, the block containers' here:

- ``embed_tokens``: vocabulary-sharded (row-wise), output reduce-scattered to ``seq``.
- norms (and MTP's ``eh_proj``): ``SequenceParallel`` (replicated weights, sequence-sharded activations).
- attention and dense MLPs: input all-gathered from ``seq``; q/k/v, MLA's ``q_proj``/``q_b_proj``/
  ``kv_b_proj`` and gate/up column-wise (heads / hidden features sharded), ``o_proj``/``down_proj``
  row-wise with output reduce-scattered back to ``seq``. MLA's low-rank ``q_a_proj``,
  ``kv_a_proj_with_mqa`` and their norms are replicated and run on the gathered input.
- MoE: see ``moe_tensor_parallel.py``.
- ``lm_head``: column-wise, logits stay a vocabulary-sharded DTensor for ``loss_parallel``
  (MTP modules share it).

Every parameter becomes a DTensor on the tp mesh (sharded or ``Replicate``), so the deterministic init,
FSDP on top, DCP checkpoints and gradient clipping see one kind of tensor.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from seektrain.models import (
    COLWISE,
    REPLICATED,
    ROWWISE,
    ROWWISE_PARTIAL,
    SEQUENCE,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
)
from seektrain.models.registry import FamilyCosts, config_of, family_of
from seektrain.parallel.moe_tensor_parallel import MoETensorParallel
from seektrain.parallel.tp_styles import AdaptedColwise, AdaptedRowwise, LocalParams, SumGrad


def _reduce_partial_grads(model: nn.Module) -> None:
    """A replicated weight applied to sequence shards (SequenceParallel) gets a ``Partial`` gradient;
    sum it once per backward, so optimizers and clipping see ordinary replicated gradients. (FSDP, when
    applied on top, replaces the parameters and does this itself.)"""

    def hook(param: torch.Tensor) -> None:  # registered on DTensor parameters only
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


# ----------------------------------------------------------------------------- the plan
def _norm_style(sp: bool) -> ParallelStyle:
    return SequenceParallel() if sp else LocalParams()


# The ParallelStyle of each TP style of the shape description (models/deepseek/shapes.py), given (seq, sp).
# Routed experts (``expert``) have none: the MoE block's style replaces them (moe_tensor_parallel.py).
# Column- and row-wise linears may carry LoRA adapters (models/lora.py): their styles place A and B to
# match (tp_styles.py); replicated ones (``LocalParams``) replicate them with the weight.
_LEAF_STYLES = {
    COLWISE: lambda seq, sp: AdaptedColwise(),
    ROWWISE: lambda seq, sp: AdaptedRowwise(output_layouts=seq, use_local_output=not sp),
    ROWWISE_PARTIAL: lambda seq, sp: AdaptedRowwise(output_layouts=Partial()),
    REPLICATED: lambda seq, sp: LocalParams(),
    SEQUENCE: lambda seq, sp: _norm_style(sp),
    VOCAB_EMBEDDING: lambda seq, sp: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=seq, use_local_output=not sp
    ),
    VOCAB_HEAD: lambda seq, sp: ColwiseParallel(
        input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
    ),
}


def _has(model: nn.Module, path: str) -> bool:
    """Whether ``model`` (possibly a pipeline stage, with parts deleted or ``None``) holds ``path``."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _block_plan(
    block: nn.Module, prefix: str, seq: Placement, sp: bool, mesh: DeviceMesh, costs: FamilyCosts
) -> dict:
    """The styles of one decoder block's containers: attention and the MLP take the all-gathered input
    (an MoE block: ``MoETensorParallel``); its leaves' styles come from the shape description."""
    # attention's positional inputs (x, cos, sin, document mask): RoPE's tables and the mask cover the
    # whole sequence (a decoding cache comes as a keyword, never under TP)
    plan = {
        f"{prefix}.self_attn": PrepareModuleInput(
            input_layouts=(seq, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        ),
        f"{prefix}.mlp": MoETensorParallel(seq, sp)
        if costs.is_moe_block(block)
        else PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
    # columns every head shares (MLA's decoupled RoPE key): each rank's heads contribute only part of
    # their gradient
    for module, start in costs.tp_summed_outputs(block):
        group = mesh.get_group()
        module.register_forward_hook(
            lambda mod, inp, out, group=group, start=start: SumGrad.apply(out, group, start)
        )
    return plan


def transformer_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of a ``Transformer`` (or a pipeline stage of one): the block
    containers' styles, then one style per described weight the model holds (``models/deepseek/shapes.py``)."""
    seq = Shard(1) if sp else Replicate()
    costs = family_of(model).costs
    plan: dict[str, ParallelStyle] = {}
    layers = model.layers
    assert isinstance(layers, nn.ModuleDict), "a family model keeps its decoder layers in a ModuleDict"
    for name, layer in layers.items():
        plan.update(_block_plan(layer, f"layers.{name}", seq, sp, tp_mesh, costs))
    for k, mtp in enumerate(getattr(model, "mtp", None) or []):
        plan.update(_block_plan(mtp.block, f"mtp.{k}.block", seq, sp, tp_mesh, costs))
    plan.update(weight_styles(model, sp))
    return plan


def weight_styles(model: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    """One style per weight of the family's shape description that ``model`` (possibly a pipeline stage)
    holds: the leaves of any family's plan, whatever its block containers need."""
    seq = Shard(1) if sp else Replicate()
    weights = family_of(model).weights(config_of(model))
    return {
        w.path: _LEAF_STYLES[w.tp](seq, sp)
        for w in weights.values()
        if w.tp in _LEAF_STYLES and _has(model, w.path)
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Shard ``model`` (a ``Transformer``, possibly a pipeline stage with some pieces ``None``) over the 1-D
    ``tp_mesh``, in place, by the plan its family's TP plan builder makes (``models/registry.py``). Call on
    the meta-device model before FSDP, ``to_empty`` and ``init_weights``;
    compute the loss under ``RunPlan.loss_context()``. The run plan has checked that every sharded
    dimension divides (seektrain/plan/layout_checks.py)."""
    if tp_mesh.size() == 1:
        return
    module, _, function = family_of(model).tp_plan.partition(":")
    build_plan = getattr(importlib.import_module(module), function)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # a LoRA base
    parallelize_module(model, tp_mesh, build_plan(model, tp_mesh, sequence_parallel))
    for name, param in model.named_parameters():  # torch's SequenceParallel drops requires_grad
        if name in frozen:
            param.requires_grad_(False)
    if config_of(model).tie_word_embeddings and model.embed_tokens is not None and model.norm is not None:
        embed, head = model.embed_tokens, model.lm_head
        assert isinstance(embed, nn.Module) and isinstance(head, nn.Module)  # last stage's embedding, head
        head.weight = embed.weight  # both vocabulary-sharded: Shard(0)
    _reduce_partial_grads(model)
