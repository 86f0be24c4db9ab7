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
  checkpoint), attention scores (SDPA), and any linear whose two dimensions are not multiples of
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

Whether this machine can run it (a CUDA device of capability 8.9+, torchao installed) is checked at
start-up by ``float8_environment_problem``; the layout rules are in ``plan/layout_checks.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from seektrain.plan.fp8_flops import RECIPE_MULTIPLE

TORCHAO_PIN = "0.17.0"  # pyproject's `fp8` extra; the release built against torch 2.11
INSTALL = f"pip install 'seektrain[fp8]' (torchao=={TORCHAO_PIN})"
EXPERT_ROW_MULTIPLE = 16  # torchao's FP8 grouped GEMM: every expert's token group a multiple of 16 rows
KEPT_BY_NAME = {"lm_head": "output head", "eh_proj": "MTP projection"}


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
        kept = "; ".join(f"{why}: {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                         for why, names in by_why.items()) or "none"
        return (f"precision.fp8={recipe}: {len(self.linears)} linears and {len(self.experts)} routed-expert "
                f"groups in FP8; linears kept in bf16: {kept}")


def _linear_kept(name: str, linear: nn.Linear, recipe: str) -> str | None:
    """Why ``linear`` stays in bf16 under ``recipe``, or None to convert it."""
    why = KEPT_BY_NAME.get(name.rsplit(".", 1)[-1])
    if why:
        return why
    multiple = RECIPE_MULTIPLE[recipe]
    if linear.in_features % multiple or linear.out_features % multiple:
        return f"{linear.in_features}x{linear.out_features} not multiples of {multiple}"
    if recipe == "blockwise" and linear.bias is not None:
        return "has a bias (torchao's blockwise layer takes none)"
    return None


def float8_targets(model: nn.Module, recipe: str, experts: bool) -> Float8Choice:
    """What ``apply_float8`` converts, without converting (needs no torchao). ``experts``: the device
    can run FP8 grouped GEMMs (``fp8_grouped_gemm_supported``)."""
    from seektrain.models.moe import GroupedExperts

    choice = Float8Choice()
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            why = _linear_kept(name, module, recipe)
            if why:
                choice.kept[name] = why
            else:
                choice.linears.append(name)
        elif isinstance(module, GroupedExperts) and experts and recipe == "rowwise":
            _, two_f, d = module.gate_up_proj.shape
            if d % 16 == 0 and (two_f // 2) % 16 == 0:
                choice.experts.append(name)
    return choice


def apply_float8(model: nn.Module, recipe: str, experts: bool) -> Float8Choice:
    """Convert ``model`` (plain, any device, meta included) for ``recipe`` in place; returns what was
    converted. Call before tensor/expert parallelism and FSDP."""
    choice = float8_targets(model, recipe, experts)
    linears = set(choice.linears)
    if recipe == "rowwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, fqn: fqn in linears)
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
            multiple = math.lcm(grouped.kernels.expert_row_multiple, EXPERT_ROW_MULTIPLE)
            grouped.kernels = dataclasses.replace(grouped.kernels, expert_row_multiple=multiple)
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
            state_dict[key] = DTensor.from_local(local._data, value.device_mesh, value.placements, run_check=False,
                                                 shape=value.shape, stride=value.stride())
        else:
            state_dict[key] = local._data


def fp8_grouped_gemm_supported(device: torch.device) -> bool:
    """torch's FP8 grouped GEMM (and seektrain's grouped-GEMM path for experts) needs SM 9.0+."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def float8_environment_problem(recipe: str, device_type: str) -> str | None:
    """Why ``precision.fp8=recipe`` cannot run here (one line with the fix), or None. Checked at start-up
    by the launcher and by every worker, on the device it trains on."""
    if recipe == "none":
        return None
    # torchao's blockwise kernels need SM 9.0; rowwise runs on any GPU with FP8 tensor cores (SM 8.9+)
    need, gpus = ((9, 0), "H100/H200/H800") if recipe == "blockwise" else ((8, 9), "H100/H200/H800/L40")
    needs = (f"precision.fp8={recipe} needs FP8 tensor cores, an {gpus}-class GPU (CUDA capability "
             f"{need[0]}.{need[1]}+)")
    fix = "--set precision.fp8=none" if recipe == "rowwise" else "--set precision.fp8=rowwise (SM 8.9) or none"
    if device_type != "cuda":
        return f"{needs}, and this run is on {device_type}; train on such a GPU or {fix}"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < need:
        return f"{needs}, and {torch.cuda.get_device_name()} has {major}.{minor}; {fix}"
    return torchao_problem(recipe)


def check_float8_environment(recipe: str, device_type: str) -> None:
    """``float8_environment_problem`` as a ``ConfigError`` (one line, exit 2)."""
    from seektrain.config.loader import ConfigError

    problem = float8_environment_problem(recipe, device_type)
    if problem:
        raise ConfigError(problem)


def torchao_problem(recipe: str) -> str | None:
    """Why torchao cannot provide ``recipe`` here (one line naming the install), or None."""
    try:
        import torchao  # noqa: F401
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except ImportError as err:
        return f"precision.fp8={recipe} needs torchao ({err}); {INSTALL}, or --set precision.fp8=none"
    if recipe == "blockwise":
        try:
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear  # noqa: F401
        except ImportError as err:
            if "triton" in str(err):
                return ("precision.fp8=blockwise needs triton (torchao's blockwise kernels), which CUDA builds of "
                        f"torch ship ({err}); install torch's CUDA build or --set precision.fp8=rowwise")
            return (f"precision.fp8=blockwise needs torchao's blockwise FP8 training (torchao {TORCHAO_PIN} has "
                    f"it; installed: {torchao.__version__}, {err}); {INSTALL}")
    return None
