"""Mixed precision: autocast for unsharded models and a dynamic loss scaler for fp16.

The scaler is our own rather than ``torch.amp.GradScaler`` because it must agree across every rank of
every parallel dimension: with sharded gradients an overflow may exist on one rank only, so the
"found inf" flag is all-reduced (MAX) over the whole world before anybody steps.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from seektrain.config.dtypes import DTYPES


def autocast_context(device: torch.device, dtype_name: str, params_already_cast: bool):
    """Autocast where parameters are fp32 in compute; FSDP's mixed-precision policy casts them itself."""
    if dtype_name == "fp32" or params_already_cast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype_name])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DynamicLossScaler:
    """Scale the loss up so fp16 gradients do not underflow; halve the scale and skip the step on
    overflow, double it after ``growth_interval`` clean steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 200,
                 min_scale: float = 1.0, device: torch.device | None = None):
        self.enabled = enabled
        self.device = device  # where the overflow flag is all-reduced (None: the gradients' device)
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params) -> bool:
        """Unscale gradients in place; returns True when every rank's gradients are finite."""
        if not self.enabled:
            return True
        grads = [_local(p.grad) for p in params if p.grad is not None]
        found_inf = torch.zeros(1, device=grads[0].device if grads else "cpu")
        if grads:  # one fused pass: the norm of a tensor holding inf or nan is not finite
            norms = torch.stack(torch._foreach_norm(grads))
            found_inf = (~torch.isfinite(norms).all()).float().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # offloaded (host) gradients: the flag still travels on the process group's device
            found_inf = found_inf.to(self.device) if self.device is not None else found_inf
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        if found_inf.item():
            return False
        inv = 1.0 / self.scale
        torch._foreach_mul_(grads, inv)
        return True

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.skipped_steps += 1
            self.good_steps = 0
            self.scale = max(self.scale / 2.0, self.min_scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
