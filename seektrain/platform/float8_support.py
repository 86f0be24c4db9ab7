"""Whether this machine can train with ``precision.fp8`` (a CUDA device with FP8 tensor cores, torchao
installed): a question about the device, so it lives with the platform, and ``RunPlan.resolve`` asks it
for a plan meant for this machine (the launcher's and every worker's, not the planner's candidates).
"""

from __future__ import annotations

import torch

TORCHAO_PIN = "0.17.0"  # pyproject's `fp8` extra; the release built against torch 2.11
INSTALL = f"pip install 'seektrain[fp8]' (torchao=={TORCHAO_PIN})"


def float8_environment_problem(recipe: str, device_type: str) -> str | None:
    """Why ``precision.fp8=recipe`` cannot run here, on ``device_type`` (one line with the fix), or None."""
    if recipe == "none":
        return None
    # torchao's blockwise kernels need SM 9.0; rowwise runs on any GPU with FP8 tensor cores (SM 8.9+)
    need, gpus = ((9, 0), "H100/H200/H800") if recipe == "blockwise" else ((8, 9), "H100/H200/H800/L40")
    needs = (
        f"precision.fp8={recipe} needs FP8 tensor cores, an {gpus}-class GPU (CUDA capability "
        f"{need[0]}.{need[1]}+)"
    )
    fix = (
        "--set precision.fp8=none" if recipe == "rowwise" else "--set precision.fp8=rowwise (SM 8.9) or none"
    )
    if device_type != "cuda":
        return f"{needs}, and this run is on {device_type}; train on such a GPU or {fix}"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < need:
        return f"{needs}, and {torch.cuda.get_device_name()} has {major}.{minor}; {fix}"
    return torchao_problem(recipe)


def torchao_problem(recipe: str) -> str | None:
    """Why torchao cannot provide ``recipe`` here (one line naming the install), or None."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except ImportError as err:
        return f"precision.fp8={recipe} needs torchao ({err}); {INSTALL}, or --set precision.fp8=none"
    if recipe == "blockwise":
        try:
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear  # noqa: F401
        except ImportError as err:
            if "triton" in str(err):
                return (
                    "precision.fp8=blockwise needs triton (torchao's blockwise kernels), which CUDA builds of "
                    f"torch ship ({err}); install torch's CUDA build or --set precision.fp8=rowwise"
                )
            return (
                f"precision.fp8=blockwise needs torchao's blockwise FP8 training (torchao {TORCHAO_PIN} has "
                f"it; installed: {torchao.__version__}, {err}); {INSTALL}"
            )
    return None
