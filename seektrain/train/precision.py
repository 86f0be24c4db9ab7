"""Mixed precision: a dynamic loss scaler for fp16 (autocast for unsharded models is ``RunPlan.autocast``).

The scaler is our own rather than ``torch.amp.GradScaler`` because it must agree across every rank of
every parallel dimension: with sharded gradients an overflow may exist on one rank only, so the
"found inf" flag is all-reduced (MAX) over the whole world before anybody steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DynamicLossScaler:
    """Scale the loss up so fp16 gradients do not underflow; halve the scale and skip the step on
    overflow, double it after ``growth_interval`` clean steps.

    The scale and the counts of clean and skipped steps live on the device and change there
    (``torch.where``), so no step waits for the device to learn whether it overflowed: ``unscale``
    returns the overflow flag as a device tensor and the optimizer skips the update itself (its
    ``found_inf``, see ``seektrain.train.step``). ``scale``, ``good_steps`` and ``skipped_steps`` read
    them on the host, for checkpoints, logs and tests; ``scale_value`` is the device value for the metrics.
    """

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_interval: int = 200,
        min_scale: float = 1.0,
        device: torch.device | None = None,
    ):
        self.enabled = enabled
        self.device = (
            device  # where the flag is all-reduced and the scale lives (None: the gradients' device, CPU)
        )
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        home = device if device is not None else "cpu"
        # float64 like the Python float it replaced: halving and doubling stay exact
        self._scale = torch.tensor(float(init_scale) if enabled else 1.0, dtype=torch.float64, device=home)
        self._good = torch.zeros((), dtype=torch.int64, device=home)
        self._skipped = torch.zeros((), dtype=torch.int64, device=home)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale if self.enabled else loss

    def unscale(self, params) -> torch.Tensor | None:
        """Unscale gradients in place and return a bool tensor: did any rank's gradients overflow (then
        the step must not update anything). None when scaling is off."""
        if not self.enabled:
            return None
        grads = [_local(p.grad) for p in params if p.grad is not None]
        found_inf = torch.zeros(1, device=grads[0].device if grads else self._scale.device)
        if grads:  # one fused pass: the norm of a tensor holding inf or nan is not finite
            norms = torch.stack(torch._foreach_norm(grads))
            found_inf = (~torch.isfinite(norms).all()).float().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # offloaded (host) gradients: the flag still travels on the process group's device
            found_inf = found_inf.to(self.device) if self.device is not None else found_inf
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        if grads:  # unscaled even on overflow: the step is skipped and the gradients dropped anyway
            torch._foreach_mul_(grads, (1.0 / self._scale).to(grads[0].device, torch.float32))
        return found_inf.reshape(()) > 0

    def update(self, finite: torch.Tensor | bool, counted: torch.Tensor | bool = True) -> None:
        """After a step whose gradients were ``finite`` (or not): grow or halve the scale. A step that is
        not ``counted`` (its update was dropped for a bad loss before the gradients mattered) changes
        nothing."""
        if not self.enabled:
            return
        finite = torch.as_tensor(finite, device=self._scale.device)
        counted = torch.as_tensor(counted, device=self._scale.device)
        good, bad = counted & finite, counted & ~finite
        self._good = torch.where(good, self._good + 1, torch.where(bad, 0, self._good))
        grow = good & (self._good % self.growth_interval == 0)
        shrunk = torch.clamp(self._scale / 2.0, min=self.min_scale)
        self._scale = torch.where(grow, self._scale * 2.0, torch.where(bad, shrunk, self._scale))
        self._skipped = self._skipped + bad

    @property
    def scale_value(self) -> torch.Tensor | float:
        """The current scale for the metrics: a device tensor (read at the next flush), 1.0 when off."""
        return self._scale if self.enabled else 1.0

    @property
    def scale(self) -> float:
        return float(self._scale)

    @property
    def good_steps(self) -> int:
        return int(self._good)

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))
        self._good.fill_(int(state["good_steps"]))
        self._skipped.fill_(int(state.get("skipped_steps", 0)))
