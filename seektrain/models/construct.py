"""One way to build any family's module: on a device ("meta" costs no memory), cast to a dtype with the
family's fp32 exceptions restored, and initialised from a seed. ``registry.build_model`` calls it for
the family of a config; a family's own loader (``deepseek/hf_io.py``) calls it with its module class,
so that no family module imports the registry that imports it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from seektrain.models.kernels import Kernels


def construct_model(
    module_class: Callable[..., nn.Module],
    keep_fp32: Callable[[nn.Module], None],
    cfg,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    seed: int = 0,
    kernels: Kernels | None = None,
) -> nn.Module:
    """``module_class(cfg, kernels)`` on ``device`` in ``dtype`` (``keep_fp32`` after a cast), its weights
    initialised from ``seed`` unless ``init`` is off or the device is meta."""
    cfg.validate()
    with torch.device(device):
        model = module_class(cfg, kernels)
    if dtype != torch.float32:
        model.to(dtype)
        keep_fp32(model)
    if init and torch.device(device).type != "meta":
        model.init_weights(seed)  # type: ignore[operator]  # every family's module has init_weights
    return model
