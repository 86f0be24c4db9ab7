"""Adapters out of seektrain: merged into the base, or as a PEFT adapter for transformers' model.

Both start from a state dict holding the base weights and the adapters (models/lora.py's names):
a linear ``P`` has ``P.lora_A [r, in]`` and ``P.lora_B [out, r]``; routed experts
``P = layers.N.mlp.experts`` have ``P.gate_up_proj_lora_A [E, r, D]``, ``P.gate_up_proj_lora_B
[E, 2F, r]``, ``P.down_proj_lora_A [E, r, F]`` and ``P.down_proj_lora_B [E, D, r]``.

Merging: ``W += scaling · B @ A``, per expert for the stacked experts, computed in fp32.

PEFT (0.21, what ``PeftModel.from_pretrained`` reads onto ``DeepseekV3ForCausalLM`` /
``DeepseekV2ForCausalLM`` / ``LlamaForCausalLM`` of transformers 5):

* No permutation is needed: transformers 5 uses our layouts (hf_weights.py maps every linear as it is,
  MLA's ``kv_b_proj`` and the interleaved RoPE rows included; the experts are fused 3-D parameters,
  ``gate_up_proj [E, 2F, D]`` and ``down_proj [E, D, F]``, as ours).
* A linear ``P`` is ``base_model.model.model.P.lora_{A,B}.weight``, the same tensors.
* The experts are PEFT's ``target_parameters`` (``lora.ParamWrapper``), which keeps one adapter per
  expert exactly as we do but packs it in two matrices: ``lora_A.weight [E·r, in]`` is our A reshaped
  (expert-major), ``lora_B.weight [out, r·E]`` is our B with the *expert index innermost*
  (``B_peft[o, k·E + e] = B[e, o, k]``; PEFT reshapes it to (out, r, E)). Two parameters of one module
  nest two wrappers: the first in the module's own order (``gate_up_proj``) is the inner one, so its
  tensors are ``…experts.base_layer.lora_A.weight`` and ``down_proj``'s ``…experts.lora_A.weight``.
* PEFT's ParamWrapper refuses dropout, so an adapter that needs ``target_parameters`` (below) is
  written with ``lora_dropout = 0`` (dropout only acts in training; the logits are the same).
* transformers builds no MTP module, so adapters of MTP blocks (``mtp.K.block.…``) have no place in
  PEFT and are left out; the merged export keeps them (its MTP layer carries the merged weights).

How PEFT is told what to adapt, and why not with patterns: for DeepSeek models PEFT 0.21 converts
configs written for transformers 4 before applying them (``peft/utils/transformers_weight_conversion.py``):
a ``target_modules`` entry whose leaf is ``gate_proj``, ``up_proj`` or ``down_proj`` is taken for a v4
per-expert projection, moved to the fused experts with rank 2r, and a regular expression is first
reduced to the leaf names it matches. So the dense MLPs' and shared experts' projections are listed in
``target_parameters`` by their weight (a 2-D ``ParamWrapper`` is the same LoRA, ``W + s·B@A``, with the
same tensor names as on a linear), and the attention projections in ``target_modules`` by their full
module path: PEFT then adapts exactly what we trained, whatever ``lora.target_modules`` patterns chose.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TypeVar

import torch

V = TypeVar("V")  # what adapter_pairs pairs: tensors or names

PEFT_PREFIX = "base_model.model."
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the module's own order: PEFT nests wrappers in it
_EXPERT_ADAPTER = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)_lora_([AB])$")
_LINEAR_ADAPTER = re.compile(r"^(.*)\.lora_([AB])$")
# PEFT rewrites target_modules entries with these leaf names for transformers-5 MoE models (module doc)
_PEFT_REMAPPED_LEAVES = ("gate_proj", "up_proj", "down_proj", "gate")


def _as_module(base: str) -> bool:
    """Whether PEFT should adapt ``base`` (a weight name) as a module (``target_modules``) rather than as a
    parameter (``target_parameters``)."""
    if not base.endswith(".weight"):
        return False  # the stacked experts
    return base.removesuffix(".weight").rsplit(".", 1)[-1] not in _PEFT_REMAPPED_LEAVES


def _base_of(name: str) -> tuple[str, str] | None:
    """(base weight name, "A" | "B") of an adapter tensor name, None for anything else."""
    m = _EXPERT_ADAPTER.match(name)
    if m:
        return f"{m.group(1)}.{m.group(2)}", m.group(3)
    m = _LINEAR_ADAPTER.match(name)
    if m:
        return f"{m.group(1)}.weight", m.group(2)
    return None


def adapter_pairs(state: dict[str, V]) -> dict[str, tuple[V, V]]:
    """Base weight name -> (A, B) for every adapted weight of ``state`` (its values: tensors, or the
    names themselves when only the names are at hand)."""
    halves: dict[str, dict[str, V]] = defaultdict(dict)
    for name, tensor in state.items():
        found = _base_of(name)
        if found:
            halves[found[0]][found[1]] = tensor
    return {base: (ab["A"], ab["B"]) for base, ab in sorted(halves.items())}


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``state`` without its adapters, each adapted weight replaced by ``W + scaling · B @ A`` (fp32 math,
    the weight's dtype kept)."""
    pairs = adapter_pairs(state)
    out = {}
    for name, tensor in state.items():
        if _base_of(name):
            continue
        if name in pairs:
            a, b = (t.detach().float() for t in pairs[name])
            delta = torch.bmm(b, a) if a.dim() == 3 else b @ a
            tensor = (tensor.detach().float() + scaling * delta).to(tensor.dtype)
        out[name] = tensor
    return out


def _peft_expert_key(module: str, param: str, adapted: set[str], half: str) -> str:
    """PEFT's name of one expert tensor's adapter half: one ``base_layer.`` per wrapper around it."""
    order = [p for p in _EXPERT_PARAMS if f"{module}.{p}" in adapted]
    depth = len(order) - 1 - order.index(param)
    return f"{PEFT_PREFIX}model.{module}.{'base_layer.' * depth}lora_{half}.weight"


def peft_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors`` (fp32, contiguous) for the adapters in ``state``."""
    pairs = {k: v for k, v in adapter_pairs(state).items() if not k.startswith("mtp.")}
    adapted = set(pairs)
    out = {}
    for base, (a, b) in pairs.items():
        a, b = a.detach().float(), b.detach().float()
        if a.dim() == 3:  # A [E, r, in], B [E, out, r]
            module, param = base.rsplit(".", 1)
            experts, rank, _ = a.shape
            a = a.reshape(experts * rank, -1)
            b = b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)  # expert index innermost
            out[_peft_expert_key(module, param, adapted, "A")] = a.contiguous()
            out[_peft_expert_key(module, param, adapted, "B")] = b.contiguous()
        else:
            module = base.removesuffix(".weight")
            out[f"{PEFT_PREFIX}model.{module}.lora_A.weight"] = a.contiguous()
            out[f"{PEFT_PREFIX}model.{module}.lora_B.weight"] = b.contiguous()
    return out


def peft_config(
    state: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float, base_model: str | None
) -> dict:
    """``adapter_config.json`` for the adapters in ``state`` (MTP left out, see the module doc)."""
    pairs = [k for k in adapter_pairs(state) if not k.startswith("mtp.")]
    modules = [k.removesuffix(".weight") for k in pairs if _as_module(k)]
    params = [f"model.{k}" for k in pairs if not _as_module(k)]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0 if params else dropout,
        "target_modules": [f"model.{m}" for m in modules] or None,
        "target_parameters": params or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
