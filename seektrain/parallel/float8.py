"""FP8 training (``precision.fp8``): swap the plain model's matmuls for torchao's float8 ones, in place,
before any other transform (torchtitan's order: the conversion must see plain ``nn.Linear`` modules and
plain parameters, and FSDP's ``fully_shard`` must see the converted ones).

What runs in FP8 follows DeepSeek-V3 (arXiv 2412.19437, sec. 3.3.1), which keeps "the embedding module,
the output head, MoE gating modules, normalization operators, and attention operators" in higher
precision:

- converted: every dense ``nn.Linear`` — attention projections (MLA's ``q_a_proj``, ``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; GQA's q/k/v/o), dense MLPs and shared experts
  (gate/up/down), in the MTP modules' decoder blocks too;
- kept in bf16: the embedding, the norms, the router (``mlp.gate``: a plain parameter, not a linear),
  the output head ``lm_head`` and each MTP module's ``eh_proj`` (bf16 in DeepSeek-V3's released FP8
  checkpoint): the weights whose ``high_precision`` the shape description (``models/deepseek/shapes.py``) sets;
  attention scores (SDPA), and any linear whose two dimensions are not multiples of
  ``RECIPE_MULTIPLE[recipe]`` (torch's FP8 GEMM needs 16; torchao's blockwise layer 128 and no bias);
- routed experts (``GroupedExperts``: one ``torch._grouped_mm`` per projection): ``rowwise`` wraps their
  fused weights in torchao's MoE-training tensor (``Float8TrainingOpConfig``), which turns that grouped
  GEMM into a rowwise-scaled FP8 grouped GEMM (``torch._scaled_grouped_mm``, SM 9.0+ only); its token
  groups must be multiples of 16 rows, so the experts' ``Kernels.expert_row_multiple`` is raised to a
  multiple of 16 (zero-row padding, same result). ``blockwise`` keeps the experts in bf16: torchao
  (0.17, 0.18) has no blockwise grouped-GEMM training path.

Recipes: ``rowwise`` is torchao's ``Float8LinearConfig.from_recipe_name("rowwise")`` (per-row scales of
inputs and weights, power-of-2 scales, e4m3 everywhere). ``blockwise`` is DeepSeek-V3's: 128×128 weight
blocks and 1×128 activation tiles, torchao's ``Float8BlockwiseLinear`` (prototype; triton kernels, SM
9.0+). FSDP's float8 all-gather (``enable_fsdp_float8_all_gather``) exists only for tensorwise scaling,
so neither recipe uses it (torchao refuses it for rowwise): FSDP gathers bf16 weights, each linear casts
them to FP8. Checkpoints hold plain tensors (``_plain_expert_tensors``), whatever was converted.

Whether this machine can run it (a CUDA device of capability 8.9+, torchao installed) is checked by
``RunPlan.resolve`` (``platform/float8_support.py``); the layout rules are in ``plan/layout_checks.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from seektrain.models import LINEAR, REPLICATED, Weight, config_of
from seektrain.models.kernels import Kernels
from seektrain.models.registry import family_of, is_family_model
from seektrain.plan.fp8_flops import experts_convert, linear_kept

EXPERT_ROW_MULTIPLE = 16  # torchao's FP8 grouped GEMM: every expert's token group a multiple of 16 rows


@dataclass
class Float8Choice:
    """Which modules run in FP8 (full names) and which linears stay in bf16, with why."""

    linears: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def describe(self, recipe: str) -> str:
        """One log line; the kept linears grouped by reason (a 61-layer model would list 62 names)."""
        by_why: dict[str, list[str]] = {}
        for name, why in self.kept.items():
            by_why.setdefault(why, []).append(name)
        kept = (
            "; ".join(
                f"{why}: {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                for why, names in by_why.items()
            )
            or "none"
        )
        return (
            f"precision.fp8={recipe}: {len(self.linears)} linears and {len(self.experts)} routed-expert "
            f"groups in FP8; linears kept in bf16: {kept}"
        )


def float8_targets(model: nn.Module, recipe: str, experts: bool) -> Float8Choice:
    """What ``apply_float8`` converts, without converting (needs no torchao): the plain ``nn.Linear``
    modules of ``model`` (whole model or pipeline stage) and its routed experts, as its shape description
    (``models/deepseek/shapes.py``) types them. ``experts``: the device can run FP8 grouped GEMMs
    (``fp8_grouped_gemm_supported``)."""
    described = family_of(model).weights(config_of(model)) if is_family_model(model) else {}
    choice = Float8Choice()
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            # a model's linears are all described (tests/test_model_shapes.py); a bare module has no policy
            linear = described.get(name) or Weight(
                name,
                LINEAR,
                module.in_features,
                module.out_features,
                REPLICATED,
                bias=module.bias is not None,
            )
            why = linear_kept(linear, recipe)
            if why:
                choice.kept[name] = why
            else:
                choice.linears.append(name)
        elif f"{name}.gate_up_proj" in described:
            if experts_convert(described[f"{name}.gate_up_proj"], recipe, experts):
                choice.experts.append(name)
    return choice


def apply_float8(model: nn.Module, recipe: str, experts: bool) -> Float8Choice:
    """Convert ``model`` (plain, any device, meta included) for ``recipe`` in place; returns what was
    converted. Call before tensor/expert parallelism and FSDP."""
    choice = float8_targets(model, recipe, experts)
    linears = set(choice.linears)
    if recipe == "rowwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name("rowwise"),
            module_filter_fn=lambda module, fqn: fqn in linears,
        )
    else:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        for name in choice.linears:
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent) if parent else model
            setattr(holder, child, Float8BlockwiseLinear.from_float(getattr(holder, child)))
    if choice.experts:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        names = set(choice.experts)
        quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: fqn in names)
        for name in choice.experts:
            grouped = model.get_submodule(name)
            kernels = grouped.kernels
            assert isinstance(kernels, Kernels), f"{name}: routed experts hold their Kernels"
            multiple = math.lcm(kernels.expert_row_multiple, EXPERT_ROW_MULTIPLE)
            grouped.kernels = dataclasses.replace(kernels, expert_row_multiple=multiple)
        # on the root: expert and tensor parallelism replace the experts modules, the root stays
        model.register_state_dict_post_hook(_plain_expert_tensors)
    return choice


def _plain_expert_tensors(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: the FP8 experts' weights as the plain tensors torchao's wrapper holds (same
    storage, so DCP still loads in place). Checkpoints then hold ordinary tensors: without it DCP pickles
    torchao's tensor subclass, which ``torch.load(weights_only=True)`` refuses and which a run without
    torchao (or with ``precision.fp8=none``) could not read."""
    from torch.distributed.tensor import DTensor
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    for key, value in state_dict.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(local, TrainingWeightWrapperBaseTensor):
            continue
        if isinstance(value, DTensor):
            state_dict[key] = DTensor.from_local(
                local._data,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        else:
            state_dict[key] = local._data


def fp8_grouped_gemm_supported(device: torch.device) -> bool:
    """torch's FP8 grouped GEMM (and seektrain's grouped-GEMM path for experts) needs SM 9.0+."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
