"""Tensor parallelism (TP) and sequence parallelism (SP), applied from outside to a plain ``Transformer``
over a 1-D ``tp`` DeviceMesh (torchtitan's recipe, with torch.distributed.tensor.parallel).

Plan (``seq`` is ``Shard(1)`` with sequence parallelism, else ``Replicate()``):

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

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from seektrain.models.moe import MoE
from seektrain.parallel.moe_tensor_parallel import moe_plan
from seektrain.parallel.tp_styles import LocalParams, SumGrad


def _reduce_partial_grads(model: nn.Module) -> None:
    """A replicated weight applied to sequence shards (SequenceParallel) gets a ``Partial`` gradient;
    sum it once per backward, so optimizers and clipping see ordinary replicated gradients. (FSDP, when
    applied on top, replaces the parameters and does this itself.)"""
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


# ----------------------------------------------------------------------------- the plan
def _norm_style(sp: bool) -> ParallelStyle:
    return SequenceParallel() if sp else LocalParams()


def _attention_plan(attn: nn.Module, prefix: str, seq: Placement, sp: bool, mesh: DeviceMesh) -> dict:
    # inputs (x, cos, sin, mask): RoPE's tables and the document mask cover the whole sequence
    plan = {prefix: PrepareModuleInput(input_layouts=(seq, None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None),
                                       use_local_output=True),
            f"{prefix}.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sp)}
    if not hasattr(attn, "kv_b_proj"):  # grouped-query attention: whole heads per rank
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        return plan
    # MLA: the low-rank projections are replicated; the up-projections are sharded by head.
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        if hasattr(attn, name):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        if hasattr(attn, name):
            plan[f"{prefix}.{name}"] = LocalParams()
    # The decoupled RoPE key (the last columns of kv_a_proj_with_mqa's output) is shared by all heads:
    # each rank's heads contribute only part of its gradient.
    group, start = mesh.get_group(), attn.kv_lora_rank
    attn.kv_a_proj_with_mqa.register_forward_hook(lambda mod, inp, out: SumGrad.apply(out, group, start))
    return plan


def _swiglu_plan(prefix: str, output: Placement, use_local_output: bool) -> dict:
    return {f"{prefix}.gate_proj": ColwiseParallel(), f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel(output_layouts=output, use_local_output=use_local_output)}


def _layer_plan(layer: nn.Module, prefix: str, seq: Placement, sp: bool, mesh: DeviceMesh) -> dict:
    plan = {f"{prefix}.input_layernorm": _norm_style(sp), f"{prefix}.post_attention_layernorm": _norm_style(sp)}
    plan.update(_attention_plan(layer.self_attn, f"{prefix}.self_attn", seq, sp, mesh))
    if isinstance(layer.mlp, MoE):
        plan.update(moe_plan(layer.mlp, f"{prefix}.mlp", seq, sp))
    else:
        plan[f"{prefix}.mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True)
        plan.update(_swiglu_plan(f"{prefix}.mlp", seq, use_local_output=not sp))
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Shard ``model`` (a ``Transformer``, possibly a pipeline stage with some pieces ``None``) over the 1-D
    ``tp_mesh``, in place. Call on the meta-device model before FSDP, ``to_empty`` and ``init_weights``;
    compute the loss under ``RunPlan.loss_context()``. The run plan has checked that every sharded
    dimension divides (seektrain/plan/layout_checks.py)."""
    if tp_mesh.size() == 1:
        return
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                               use_local_output=not sp)
    for name, layer in model.layers.items():
        plan.update(_layer_plan(layer, f"layers.{name}", seq, sp, tp_mesh))
    if model.norm is not None:
        plan["norm"] = _norm_style(sp)
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    for k, mtp in enumerate(getattr(model, "mtp", None) or []):
        for name in ("enorm", "hnorm", "eh_proj", "norm"):
            plan[f"mtp.{k}.{name}"] = _norm_style(sp)
        plan.update(_layer_plan(mtp.block, f"mtp.{k}.block", seq, sp, tp_mesh))
    parallelize_module(model, tp_mesh, plan)
    if model.cfg.tie_word_embeddings and model.embed_tokens is not None and model.norm is not None:
        model.lm_head.weight = model.embed_tokens.weight  # both vocabulary-sharded: Shard(0)
    _reduce_partial_grads(model)
