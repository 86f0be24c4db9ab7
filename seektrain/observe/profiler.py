"""Two looks inside a step: a torch.profiler Chrome trace of chosen steps, and FLOPs per module.

``StepProfiler`` records only the steps asked for (profiling every step slows training and writes
gigabytes). ``flops_breakdown`` answers "which module costs what" in the style of DeepSpeed's
FlopsProfiler, from the ops actually executed (``FlopCounterMode``), so it also checks the analytic
count of ``flops.py`` on a real model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from seektrain.observe.counting import ModuleFlopCounter


class StepProfiler:
    """Chrome traces ``run_dir/profile/trace-step<N>.json`` of the given steps.

    Drive it with ``before_step(n)`` / ``after_step(n)`` around every step. Open a trace in
    https://ui.perfetto.dev or chrome://tracing.
    """

    def __init__(
        self, run_dir: Path | str, steps: Iterable[int], record_shapes: bool = True, with_stack: bool = False
    ) -> None:
        self.out_dir = Path(run_dir) / "profile"
        self.steps = frozenset(int(s) for s in steps)
        self.record_shapes, self.with_stack = record_shapes, with_stack
        self.traces: list[Path] = []
        self._active: profile | None = None
        self._active_step: int | None = None

    def before_step(self, step: int) -> None:
        """Begin capturing if ``step`` is wanted (closing any capture left open)."""
        self._finish()
        if step not in self.steps:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._active = profile(
            activities=activities, record_shapes=self.record_shapes, with_stack=self.with_stack
        )
        self._active.__enter__()
        self._active_step = step

    def after_step(self, step: int) -> None:
        """Write the trace of ``step`` if it was being captured."""
        if self._active_step == step:
            self._finish()

    def _finish(self) -> None:
        if self._active is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the step's kernels belong in its trace
        self._active.__exit__(None, None, None)
        path = self.out_dir / f"trace-step{self._active_step}.json"
        self._active.export_chrome_trace(str(path))
        self.traces.append(path)
        self._active, self._active_step = None, None


@dataclass(frozen=True)
class FlopsRow:
    module: str  # dotted path inside the model ("" is the whole model)
    depth: int  # 0 for the model, 1 for its children, ...
    params: int  # parameters owned by the module and its children
    flops: int  # forward + backward FLOPs of the module and its children
    forward_flops: int  # of which forward
    fraction: float  # of the whole model's FLOPs


def flops_breakdown(
    model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor | None = None
) -> list[FlopsRow]:
    """Forward + backward FLOPs per module for one batch; gradients are returned, not accumulated,
    and MoE token counters are restored, so the model is left as it was."""
    saved = {m: list(m.expert_counts) for m in model.modules() if hasattr(m, "expert_counts")}
    params = [p for p in model.parameters() if p.requires_grad]
    counter = ModuleFlopCounter(model)
    try:
        with counter:
            use_mtp = labels is not None and len(getattr(model, "mtp", ()) or ())
            out = model(tokens, mtp_tokens=tokens if use_mtp else None)
            logits, extra = out.logits, list(out.mtp)
            if labels is None:
                loss = logits.float().mean()
            else:
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss = loss + sum((x.float().mean() for x in extra), torch.zeros((), device=loss.device))
            torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for module, value in saved.items():
            module.expert_counts[:] = value
    total = counter.total or 1
    rows = []
    for name, module in model.named_modules():
        flops = counter.flops.get(name, 0)
        rows.append(
            FlopsRow(
                module=name,
                depth=name.count(".") + 1 if name else 0,
                params=sum(p.numel() for p in module.parameters()),
                flops=flops,
                forward_flops=counter.forward_flops.get(name, 0),
                fraction=flops / total,
            )
        )
    return rows


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def format_flops_table(rows: list[FlopsRow], depth: int = 2) -> str:
    """A table of the modules down to ``depth`` (0 = the model only), indented by nesting."""
    shown = [r for r in rows if r.depth <= depth and (r.flops or r.params)]
    names = [("  " * r.depth) + (r.module.rsplit(".", 1)[-1] if r.module else "model") for r in shown]
    width = max([len("module")] + [len(n) for n in names])
    lines = [
        f"{'module':<{width}}  {'params':>10}  {'fwd FLOPs':>14}  {'fwd+bwd FLOPs':>14}  {'share':>6}",
        "-" * (width + 54),
    ]
    for name, row in zip(names, shown):
        lines.append(
            f"{name:<{width}}  {_human(row.params):>10}  {_human(row.forward_flops, 'FLOPs'):>14}  "
            f"{_human(row.flops, 'FLOPs'):>14}  {row.fraction:>6.1%}"
        )
    return "\n".join(lines)
