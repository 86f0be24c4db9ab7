"""LoRA: low-rank adapters on a frozen base (``[lora]``; docs/finetuning.md, "LoRA: low-rank adapters").

An adapted linear ``P`` computes ``P(x) + scaling * B @ A @ dropout(x)`` with ``A [r, in]`` and
``B [out, r]`` registered on ``P`` itself as ``P.lora_A`` and ``P.lora_B``. The base module is left as
it is (its class, its ``weight``/``bias``): the adapter is added to its output by a forward hook. That
is why it composes with everything that replaces or wraps the base: FP8 (torchao swaps ``nn.Linear``
for its float8 linear first; the adapters are added afterwards, the hook then adds a bf16 update to an
FP8 matmul), tensor parallelism (the base module's ``ParallelStyle`` sees its own linear;
``parallel/tensor_parallel.py`` places A and B to match it), FSDP, activation checkpointing and compile.

The routed experts ``P = …mlp.experts`` (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``) get one
adapter per expert: ``P.gate_up_proj_lora_A [E, r, D]``, ``P.gate_up_proj_lora_B [E, 2F, r]``,
``P.down_proj_lora_A [E, r, F]``, ``P.down_proj_lora_B [E, D, r]``. ``models/deepseek/moe.py``'s
``grouped_swiglu`` runs them as grouped GEMMs over the same token groups as the base experts (or the
same padded batched matmul), never a loop over experts; expert and tensor parallelism hand it their
local experts' adapters as they hand it their local weights.

What is adapted comes from the shape description (``models/deepseek/shapes.py``) alone, so the planner and the
exports read the same answer without building a model (``adapter_weights``). Target groups:
``attention`` (MLA's q_proj/q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj, GQA's q/k/v/o_proj),
``mlp`` (dense MLPs, MTP blocks' included), ``shared_experts``, ``experts`` (routed); anything else is an
fnmatch pattern over module paths. Never the embedding, the head, the router, the norms or MTP's
``eh_proj``. This module knows no config section: whoever holds the job builds the ``LoraSpec``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from seektrain.errors import UserError
from seektrain.models import (
    COLWISE,
    EXPERTS,
    LINEAR,
    REPLICATED,
    ROWWISE,
    ROWWISE_PARTIAL,
    Weight,
)
from seektrain.models.config import ModelConfig

GROUPS = ("attention", "mlp", "shared_experts", "experts")
_GROUP_WHAT = {
    "attention": "attention projections",
    "mlp": "dense MLP layers",
    "shared_experts": "shared experts",
    "experts": "routed experts",
}
# the linears' TP styles an adapter follows (parallel/tensor_parallel.py); the head, the embedding and
# MTP's sequence-parallel eh_proj are never adapted
_ADAPTABLE_TP = (COLWISE, ROWWISE, ROWWISE_PARTIAL, REPLICATED)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how: ``targets`` are ``lora.target_modules`` (groups or fnmatch patterns)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = GROUPS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_values(cls, rank: int, alpha: float, dropout: float, targets) -> LoraSpec:
        return cls(int(rank), float(alpha), float(dropout), tuple(targets))


def is_adapter(name: str) -> bool:
    """The one test for "this parameter (state-dict key, optimizer entry) is an adapter"."""
    return "lora_" in name


@dataclass(frozen=True)
class AdapterShapes:
    """The two adapter tensors of one base weight: state-dict names and shapes (full, unsharded)."""

    weight: Weight  # the adapted base weight (its TP style, expert count, layer ...)
    a_name: str
    a: tuple[int, ...]
    b_name: str
    b: tuple[int, ...]

    @property
    def numel(self) -> int:
        a = b = 1
        for n in self.a:
            a *= n
        for n in self.b:
            b *= n
        return a + b


def _group(weight: Weight) -> str | None:
    """The target group of a described weight; None where no adapter may go."""
    if weight.kind == EXPERTS:
        return "experts"
    if weight.kind != LINEAR or weight.tp not in _ADAPTABLE_TP:
        return None
    parent = weight.path.rpartition(".")[0]
    if parent.endswith(".self_attn"):
        return "attention"
    if parent.endswith(".mlp.shared_experts"):
        return "shared_experts"
    if parent.endswith(".mlp"):
        return "mlp"
    return None


def module_path(weight: Weight) -> str:
    """The module that holds ``weight`` (the experts' module for their fused weights)."""
    return weight.path.rpartition(".")[0] if weight.kind == EXPERTS else weight.path


def targeted_weights(cfg: ModelConfig, spec: LoraSpec) -> list[Weight]:
    """The described base weights ``spec`` adapts, in module order; one ``UserError`` line for a target
    that selects nothing. A group the model lacks is an error unless the list names every group (the
    default: "every adaptable module this model has", which must work for a dense model too)."""
    from seektrain.models.registry import family_for  # the registry imports the modules LoRA adapts

    adaptable = [w for w in family_for(cfg).weights(cfg).values() if _group(w)]
    every_group = set(GROUPS) <= set(spec.targets)
    chosen: set[str] = set()
    for target in spec.targets:
        if target in GROUPS:
            hits = [w for w in adaptable if _group(w) == target]
            if not hits and not every_group:
                raise UserError(
                    f"lora.target_modules: model {cfg.name!r} has no {_GROUP_WHAT[target]} "
                    f"({target!r}); drop it from the list"
                )
        else:
            hits = [w for w in adaptable if fnmatch.fnmatchcase(module_path(w), target)]
            if not hits:
                raise UserError(
                    f"lora.target_modules: {target!r} matches no adaptable module of {cfg.name!r} "
                    "(attention projections, MLPs, shared and routed experts, by module path, e.g. "
                    "'*.self_attn.o_proj' or 'layers.*.mlp.experts'); fix the pattern"
                )
        chosen.update(w.path for w in hits)
    return [w for w in adaptable if w.path in chosen]


def adapter_weights(cfg: ModelConfig, spec: LoraSpec) -> dict[str, AdapterShapes]:
    """For every adapted base weight (its name as in ``Weight.params``: ``….q_b_proj.weight``,
    ``….mlp.experts.gate_up_proj``) the shapes of its two adapters, from ``cfg`` alone. Refuses (one
    ``UserError`` line) a rank above a target's smallest dimension."""
    out: dict[str, AdapterShapes] = {}
    r = spec.rank
    for w in targeted_weights(cfg, spec):
        smallest = min(w.in_features, w.out_features)
        if r > smallest:
            limit = min(min(t.in_features, t.out_features) for t in targeted_weights(cfg, spec))
            raise UserError(
                f"lora.rank={r} exceeds the smallest dimension ({smallest}) of {w.path} "
                f"[{w.out_features} x {w.in_features}]; choose lora.rank <= {limit} or leave it out of "
                "lora.target_modules"
            )
        if w.kind == EXPERTS:
            e = w.experts
            out[w.weight_name] = AdapterShapes(
                w, f"{w.path}_lora_A", (e, r, w.in_features), f"{w.path}_lora_B", (e, w.out_features, r)
            )
        else:
            out[w.weight_name] = AdapterShapes(
                w, f"{w.path}.lora_A", (r, w.in_features), f"{w.path}.lora_B", (w.out_features, r)
            )
    return out


# ------------------------------------------------------------------------------------- the model side
def _linear_adapter(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted linear: its output plus ``scaling * B @ A @ dropout(x)``. Runs on
    whatever the module's forward saw: DTensors under tensor parallelism (registered before the TP
    style's own hooks), local tensors under ``LocalParams``."""
    dropout, scaling = _setting(module, "lora_dropout"), _setting(module, "lora_scaling")
    x = F.dropout(args[0], dropout, module.training) if dropout else args[0]
    a, b = _tensor(module, "lora_A"), _tensor(module, "lora_B")
    return output + scaling * F.linear(F.linear(x, a), b)


def adapted_weight(linear: nn.Module) -> torch.Tensor:
    """The weight [out, in] a linear applies in effect: ``W + scaling * B @ A`` where it has an adapter,
    its ``weight`` where not. For code that multiplies by slices of the weight instead of calling the
    module, and would otherwise miss the hook's update (MLA's absorbed decode splits ``kv_b_proj`` by
    head). No dropout: that code runs in evaluation."""
    weight = _tensor(linear, "weight")
    if not hasattr(linear, "lora_A"):
        return weight
    a, b = _tensor(linear, "lora_A"), _tensor(linear, "lora_B")
    delta = _setting(linear, "lora_scaling") * (b.float() @ a.float())
    return (weight.float() + delta).to(torch.promote_types(weight.dtype, a.dtype))


def _setting(module: nn.Module, name: str) -> float:
    """An adapter setting ``add_adapters`` left on ``module`` (a plain attribute)."""
    return float(getattr(module, name))


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor)
    return value


def _holds(model: nn.Module, path: str) -> bool:
    """Whether ``model`` (maybe a pipeline stage, whose missing parts are deleted or ``None``) has ``path``."""
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def add_adapters(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Register ``spec``'s adapters (fp32, uninitialised; ``init_weights`` fills them: A like PEFT's
    kaiming-uniform, B zeros) on the modules of ``model`` (a family model or a pipeline stage of one,
    any device, meta included) and return the adapted modules' paths. Call after FP8 conversion and
    before expert/tensor parallelism, FSDP, ``to_empty`` and ``init_weights``."""
    adapted: list[str] = []
    cfg = model.cfg
    assert isinstance(cfg, ModelConfig)  # every family model carries its config
    for shapes in adapter_weights(cfg, spec).values():
        path = module_path(shapes.weight)
        if not _holds(model, path):
            continue
        module = model.get_submodule(path)
        device = next(module.parameters()).device
        for full, shape in ((shapes.a_name, shapes.a), (shapes.b_name, shapes.b)):
            param = nn.Parameter(torch.empty(shape, device=device, dtype=torch.float32))
            module.register_parameter(full.rpartition(".")[2], param)
        # plain attributes, read by the adapter's forward (nn.Module's typing knows tensors and modules)
        module.lora_scaling = spec.scaling  # type: ignore[assignment]
        module.lora_dropout = spec.dropout  # type: ignore[assignment]
        if shapes.weight.kind == LINEAR:
            module.register_forward_hook(_linear_adapter)
        if path not in adapted:
            adapted.append(path)
    return adapted


@torch.no_grad()
def frozen_dtype(held: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype a frozen base parameter held in ``held`` is kept in under base dtype ``dtype``: cast
    down to it when wider, never up."""
    return dtype if held.is_floating_point and held.itemsize > dtype.itemsize else held


def freeze_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter that is not an adapter: no gradient, stored in ``dtype`` (the compute dtype: a
    frozen weight needs no fp32 master)."""
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        param.requires_grad_(False)
        if frozen_dtype(param.dtype, dtype) != param.dtype:
            param.data = param.data.to(dtype)


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter elements of ``model`` as this rank holds them (local shards)."""
    from torch.distributed.tensor import DTensor

    trainable = frozen = 0
    for param in model.parameters():
        n = (param.to_local() if isinstance(param, DTensor) else param).numel()
        if param.requires_grad:
            trainable += n
        else:
            frozen += n
    return trainable, frozen


class ExpertAdapters(NamedTuple):
    """The routed experts' adapters as ``grouped_swiglu`` runs them (this rank's experts, local tensors)."""

    gate_up_A: torch.Tensor  # [E, r, D]
    gate_up_B: torch.Tensor  # [E, 2F, r]
    down_A: torch.Tensor  # [E, r, F]
    down_B: torch.Tensor  # [E, D, r]
    scaling: float
    dropout: float
    training: bool

    @property
    def rank(self) -> int:
        return self.gate_up_A.shape[1]

    def cast(self, dtype: torch.dtype) -> ExpertAdapters:
        return self._replace(**{k: getattr(self, k).to(dtype) for k in self._fields[:4]})

    def delta(self, which: str, x: torch.Tensor, mm: Callable) -> torch.Tensor:
        """``scaling * B @ A @ dropout(x)`` of projection ``which`` ("gate_up" or "down"), each product by
        ``mm(x, w)`` (``x @ w^T`` per expert group: the caller's grouped GEMM or batched matmul)."""
        a, b = getattr(self, f"{which}_A"), getattr(self, f"{which}_B")
        if self.dropout:
            x = F.dropout(x, self.dropout, self.training)
        return self.scaling * mm(mm(x, a), b)


def expert_adapters(
    experts: nn.Module, local: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> ExpertAdapters | None:
    """The adapters registered on an experts module, each passed through ``local`` (expert/tensor
    parallelism: the DTensor's local experts, with their gradient scale); None when it has none."""
    if getattr(experts, "gate_up_proj_lora_A", None) is None:
        return None
    local = local or (lambda t: t)
    gate_up_A, gate_up_B, down_A, down_B = (
        local(getattr(experts, f"{w}_lora_{ab}")) for w in EXPERT_WEIGHTS for ab in "AB"
    )
    scaling, dropout = _setting(experts, "lora_scaling"), _setting(experts, "lora_dropout")
    return ExpertAdapters(gate_up_A, gate_up_B, down_A, down_B, scaling, dropout, experts.training)
