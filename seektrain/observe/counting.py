"""Counting executed FLOPs: formulas torch lacks, and a per-module counter that is right in backward.

torch's counter (2.13) has no formula for ``aten._grouped_mm`` (the MoE experts) nor for the CPU
flash-attention kernel; without them a MoE model's routed experts and all CPU attention would read as
zero FLOPs. The formulas here follow the model-FLOPs convention of ``flops.py``: attention backward
is 2 x forward (torch's own CUDA flash/efficient formulas add the recomputed scores on top). The count
is of the model as built: one built with the default (plain) ``Kernels``, as ``seektrain flops`` does,
counts the model's work; one built with the CPU policy's kernels also counts their padding
(``seektrain/platform/cpu_kernels.py``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

aten = torch.ops.aten


def grouped_mm_flop(a_shape, b_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    """2 x M x K x N summed over groups, for the four layouts of ``_grouped_mm``:
    2D x 3D (tokens x per-expert weights), 3D x 2D, 2D x 2D (weight gradient: groups along K,
    output [G, M, N]) and 3D x 3D (plain batched). Only the 3D x 3D case multiplies every group fully."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        g, m, k = a_shape
        return 2 * g * m * k * b_shape[-1]
    return 2 * a_shape[-2] * a_shape[-1] * b_shape[-1]


def cpu_sdpa_flop(query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    """Full (mask-blind, like torch's own) QK^T + PV FLOPs of the CPU flash kernel."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def cpu_sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any
) -> int:
    """Backward = 2 x forward (dQ, dK from dScores; dScores, dV from dO), no recomputation counted."""
    return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


def extra_flop_formulas() -> dict[Any, Any]:
    """Formulas to pass as ``FlopCounterMode(custom_mapping=...)``; ops this torch lacks are skipped."""
    table: dict[Any, Any] = {}
    for name, formula in (
        ("_grouped_mm", grouped_mm_flop),
        ("_scaled_dot_product_flash_attention_for_cpu", cpu_sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", cpu_sdpa_backward_flop),
    ):
        op = getattr(aten, name, None)
        if op is not None:
            table[op] = formula
    return table


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: ModuleFlopCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.owner._count(func.overloadpacket, out, args, kwargs)
        return out


class ModuleFlopCounter:
    """FLOPs per module path, forward and backward, inclusive of children (``""`` is the whole model
    plus anything run outside it, such as the loss).

    Forward ops go to the module whose forward is running (module hooks keep a stack). Backward ops go
    to the module whose forward created the autograd node being executed: each module call records
    the range of autograd sequence numbers it allocated, and the innermost range holding the current
    node's number wins. ``FlopCounterMode``'s own tracker loses its place in backward when a module's
    inputs need no gradient (the embedding), and then charges later FLOPs to the wrong module.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.registry = FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()).flop_registry
        self.flops: dict[str, int] = defaultdict(int)
        self.forward_flops: dict[str, int] = defaultdict(int)
        self._stack: list[tuple[str, int]] = []
        self._intervals: list[tuple[int, int, str]] = []
        self._handles: list[Any] = []
        self._mode: _Dispatch | None = None

    @property
    def total(self) -> int:
        return self.flops.get("", 0)

    def _pre(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append((name, _seq()))

        return hook

    def _post(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            while self._stack:
                top, start = self._stack.pop()
                if top == name:
                    self._intervals.append((start, _seq(), name))
                    break

        return hook

    def _owner_of(self, seq: int) -> str:
        best, best_len = "", None
        for start, end, name in self._intervals:
            if start <= seq < end and (best_len is None or end - start < best_len):
                best, best_len = name, end - start
        return best

    def _count(self, packet: Any, out: Any, args: Any, kwargs: Any) -> None:
        formula = self.registry.get(packet)
        if formula is None:
            return
        flops = int(formula(*args, **kwargs, out_val=out))
        node = torch._C._current_autograd_node()
        backward = node is not None
        path = (
            self._owner_of(node._sequence_nr()) if backward else (self._stack[-1][0] if self._stack else "")
        )
        parts = path.split(".") if path else []
        for i in range(len(parts), -1, -1):
            key = ".".join(parts[:i])
            self.flops[key] += flops
            if not backward:
                self.forward_flops[key] += flops

    def __enter__(self) -> ModuleFlopCounter:
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_pre_hook(self._pre(name)))
                self._handles.append(module.register_forward_hook(self._post(name)))
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()


def _seq() -> int:
    """The autograd sequence number the next node created on this thread will get."""
    return torch._C._autograd._get_sequence_nr()
