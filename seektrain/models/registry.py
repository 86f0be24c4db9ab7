"""Model families by name: everything the trainer, the planner and ``seektrain.parallel`` need to know of a
kind of model, in one entry.

A family is its config class and the ``arch`` values (== Hugging Face ``model_type``) it builds, the
``config.json`` architecture names it reads, its module class, its shape description (every weight, its
TP style and dtype policy: ``models/deepseek/shapes.py``), the TP plan builder that turns a built model into a
``parallelize_module`` plan, and its pipeline rules (which parts a pipeline stage keeps). Code outside
``models/`` asks this registry (``family_for(cfg)``, ``family_of(model)``) instead of naming a class, so a
new family is one folder plus one entry here; docs/architecture.md, "How to add a model family", lists
what the entry must provide.

The TP plan builder is named by its import path (``module:function``) rather than imported: models know
nothing of parallelism, ``seektrain.parallel`` resolves it (``parallel/tensor_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from seektrain.errors import UserError
from seektrain.models.config import ARCHITECTURES, ModelConfig
from seektrain.models.construct import construct_model
from seektrain.models.deepseek import costs, presets, shapes
from seektrain.models.deepseek.hf_config import ARCH_BY_HF
from seektrain.models.deepseek.hf_io import load_hf_weights
from seektrain.models.deepseek.transformer import Transformer, keep_fp32_buffers
from seektrain.models.hf_slice_reader import LoadReport
from seektrain.models.kernels import Kernels


@dataclass(frozen=True)
class PipelineRules:
    """How a pipeline stage is cut from a model (``parallel/pipeline.py``): the decoder blocks live in the
    ``ModuleDict`` ``layers`` keyed by global index, a stage keeps its own; ``first`` parts only on the
    first stage, ``last`` parts only on the last (set to ``None`` elsewhere; the forward skips them).
    ``blocks``: the containers of repeated blocks, each block its own FSDP and compile unit."""

    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class FamilyCosts:
    """What the planner, the FLOP counter, the layout checks and the TP plan ask of a family beyond its
    shape description, so that generic code reads no family-only config field (DeepSeek's:
    ``models/deepseek/costs.py``). Activation terms are bytes per token of one tensor-parallel rank
    (``tp`` ranks, ``a`` bytes per element of the compute dtype) that the family's modules save for
    backward (``plan/memory.py`` adds the norms, the dense MLP and the head)."""

    # (cfg, a, tp, pad_values, ring) -> attention's saved bytes per token (ring: context parallelism's)
    attention_bytes: Callable[[ModelConfig, int, int, bool, bool], float]
    # (cfg, a, tp, pad_values) -> what selective checkpointing keeps of attention, o_proj's output aside
    selective_attention_bytes: Callable[[ModelConfig, int, int, bool], float]
    # (cfg, a, tp) -> a dense layer's MLP saved bytes per token (``plan/memory.py`` adds its input norm)
    dense_mlp_bytes: Callable[[Any, int, int], float]
    # (cfg, a, tp, ep) -> a MoE layer's MLP saved bytes per token (``cfg.is_moe_layer``)
    moe_bytes: Callable[[ModelConfig, int, int, int], float]
    # (cfg, a, tp, ep) -> (kept, tail) of a selectively checkpointed MoE layer's MLP
    selective_moe_bytes: Callable[[ModelConfig, int, int, int], tuple[float, float]]
    # cfg -> width of a block's norms that TP replicates (the residual norms are sequence-sharded)
    replicated_norm_width: Callable[[ModelConfig], int]
    # cfg -> the routed experts expert parallelism splits (0: dense)
    routed_experts: Callable[[ModelConfig], int]
    # (cfg, tokens) -> one routed expert's (m, k, n) matmul for ``tokens`` rows, None when dense
    expert_matmul_shape: Callable[[ModelConfig, int], tuple[int, int, int] | None]
    # decoder block -> [(module, start)]: outputs whose columns from ``start`` every head shares, their
    # gradient summed over the tp group
    tp_summed_outputs: Callable[[nn.Module], list[tuple[nn.Module, int]]]
    # decoder block -> whether its MLP is the family's MoE layer (TP's ``MoETensorParallel``)
    is_moe_block: Callable[[nn.Module], bool]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_class: type
    archs: tuple[str, ...]  # the config's ``arch`` values; also the Hugging Face ``model_type``
    hf_architectures: tuple[str, ...]  # config.json ``architectures`` names (models/deepseek/hf_config.py)
    module_class: type[nn.Module]  # ``module_class(cfg, kernels)``; has ``cfg`` and ``init_weights(seed)``
    weights: Callable[[ModelConfig], dict]  # cfg -> {path: shapes.Weight}, every weight of the model
    tp_plan: str  # "module:function": (model, tp_mesh, sequence_parallel) -> parallelize_module plan
    pipeline: PipelineRules
    keep_fp32: Callable[[nn.Module], None]  # after a cast to a low dtype: restore what must stay fp32
    # (local shards, cfg, Hugging Face folder) -> LoadReport: fill a rank's local tensors (the boxes of
    # the full tensors it holds) from the folder, reading only those slices (``models/hf_slice_reader.py``)
    load_hf: Callable[[list, ModelConfig, str], LoadReport]
    costs: FamilyCosts
    # preset name -> a builder of its config (``model.preset=`` finds it through ``get_preset``)
    presets: Mapping[str, Callable[[], Any]] = field(default_factory=dict)


FAMILIES: dict[str, ModelFamily] = {
    "deepseek": ModelFamily(
        name="deepseek",
        config_class=ModelConfig,
        archs=ARCHITECTURES,
        hf_architectures=tuple(ARCH_BY_HF),
        module_class=Transformer,
        weights=shapes.weights_by_path,
        tp_plan="seektrain.parallel.tensor_parallel:transformer_tp_plan",
        pipeline=PipelineRules(
            layers="layers", first=shapes.FIRST_STAGE, last=shapes.LAST_STAGE, blocks=("layers", "mtp")
        ),
        keep_fp32=keep_fp32_buffers,
        load_hf=load_hf_weights,
        costs=FamilyCosts(
            attention_bytes=costs.attention_bytes,
            selective_attention_bytes=costs.selective_attention_bytes,
            dense_mlp_bytes=costs.dense_mlp_bytes,
            moe_bytes=costs.moe_bytes,
            selective_moe_bytes=costs.selective_moe_bytes,
            replicated_norm_width=costs.replicated_norm_width,
            routed_experts=costs.routed_experts,
            expert_matmul_shape=costs.expert_matmul_shape,
            tp_summed_outputs=costs.tp_summed_outputs,
            is_moe_block=costs.is_moe_block,
        ),
        presets=presets.BUILDERS,
    ),
}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to ``FAMILIES``: the public entry for a family that lives outside this package
    (a plugin, an example, a test). Its name, archs and presets must be new."""
    taken = {a for f in FAMILIES.values() for a in f.archs} & set(family.archs)
    clash = set(preset_names()) & set(family.presets)
    if family.name in FAMILIES or taken or clash:
        what = family.name if family.name in FAMILIES else ", ".join(sorted(taken or clash))
        raise UserError(f"model family {family.name!r}: {what} is registered already")
    FAMILIES[family.name] = family
    return family


def preset_names() -> tuple[str, ...]:
    """Every registered family's preset names, the DeepSeek ones first."""
    return tuple(name for f in FAMILIES.values() for name in f.presets)


def get_preset(name: str) -> Any:
    """The validated config of preset ``name``, from whichever family registered it."""
    for family in FAMILIES.values():
        if name in family.presets:
            return family.presets[name]().validate()
    raise UserError(f"unknown model preset {name!r}; choose one of: {', '.join(preset_names())}")


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise UserError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_for(cfg: ModelConfig) -> ModelFamily:
    """The family that builds ``cfg`` (by its config class and ``arch``)."""
    for family in FAMILIES.values():
        if isinstance(cfg, family.config_class) and cfg.arch in family.archs:
            return family
    known = ", ".join(a for f in FAMILIES.values() for a in f.archs)
    raise UserError(
        f"model config {getattr(cfg, 'name', '?')!r}: no model family builds arch={cfg.arch!r} "
        f"(known: {known})"
    )


def family_of(model: nn.Module) -> ModelFamily:
    """The family whose module class ``model`` (a whole model or a pipeline stage of one) is; the most
    derived one when a family's module class subclasses another's."""
    for cls in type(model).__mro__:
        for family in FAMILIES.values():
            if family.module_class is cls:
                return family
    raise TypeError(f"{type(model).__name__} is not the module class of a registered model family")


def config_of(model: nn.Module) -> ModelConfig:
    """The config a family's model was built from (every family's module keeps it as ``cfg``)."""
    cfg: Any = getattr(model, "cfg", None)
    if not any(isinstance(cfg, f.config_class) for f in FAMILIES.values()):
        raise TypeError(f"{type(model).__name__} has no model config (.cfg)")
    return cfg


def is_family_model(model: nn.Module) -> bool:
    return any(isinstance(model, f.module_class) for f in FAMILIES.values())


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (a whole model or a pipeline stage), in order: the units FSDP
    shards and ``train.compile`` compiles one by one."""
    out: list[nn.Module] = []
    for name in family_of(model).pipeline.blocks:
        container = getattr(model, name, None)
        out += list(container.values() if isinstance(container, nn.ModuleDict) else container or [])
    return out


def build_model(
    cfg,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    seed: int = 0,
    kernels: Kernels | None = None,
) -> nn.Module:
    """The model of ``cfg``'s family on ``device`` ("meta" costs no memory for any size; call
    ``init_weights`` after ``to_empty``). ``kernels``: the platform's
    (``seektrain.platform.policy_for(device).model_kernels()``) for training; the default, plain ones
    count FLOPs exactly and serve as the reference."""
    family = family_for(cfg)
    return construct_model(family.module_class, family.keep_fp32, cfg, device, dtype, init, seed, kernels)
