"""What ``precision.fp8`` converts, decided on the shape description (``models/deepseek/shapes.py``) alone: the
rules ``parallel/float8.py`` applies to the modules, and the FP8 weights per token that the planner's time
model counts with them (tests/test_float8.py holds the two equal). Here, not in parallel/, so the planner
needs nothing of parallel/."""

from __future__ import annotations

from seektrain.models import EXPERTS, LINEAR, Weight
from seektrain.models.config import ModelConfig
from seektrain.models.registry import family_for

RECIPE_MULTIPLE = {
    "rowwise": 16,
    "blockwise": 128,
}  # torch's FP8 GEMM needs 16; torchao's blockwise layer 128


def linear_kept(linear: Weight, recipe: str) -> str | None:
    """Why ``linear`` stays in bf16 under ``recipe`` (its dtype policy, or a shape or bias the recipe's
    layer cannot take), or None to convert it."""
    if linear.high_precision:
        return linear.high_precision
    multiple = RECIPE_MULTIPLE[recipe]
    if linear.in_features % multiple or linear.out_features % multiple:
        return f"{linear.in_features}x{linear.out_features} not multiples of {multiple}"
    if recipe == "blockwise" and linear.bias:
        return "has a bias (torchao's blockwise layer takes none)"
    return None


def experts_convert(gate_up: Weight, recipe: str, experts: bool) -> bool:
    """Whether the routed experts whose fused ``gate_up_proj`` is ``gate_up`` run in FP8: rowwise only,
    on a device with FP8 grouped GEMMs, with D and F multiples of 16."""
    return (
        experts
        and recipe == "rowwise"
        and gate_up.in_features % 16 == 0
        and (gate_up.out_features // 2) % 16 == 0
    )


def fp8_matmul_params(cfg: ModelConfig, recipe: str, include_mtp: bool = True, experts: bool = True) -> int:
    """Weights one token multiplies with in FP8 under ``recipe``: ``float8_targets`` counted on the shape
    description instead of modules (tests/test_float8.py holds them equal), for the planner's time
    model. ``experts`` as there."""
    if recipe == "none":
        return 0
    described, total = family_for(cfg).weights(cfg), 0
    for w in described.values():
        if w.block is None or (w.layer is None and not include_mtp):
            continue
        if w.kind == LINEAR and not linear_kept(w, recipe):
            total += w.matmul_params
        elif w.kind == EXPERTS and experts_convert(
            described[f"{w.path.rsplit('.', 1)[0]}.gate_up_proj"], recipe, experts
        ):
            total += w.matmul_params
    return total
