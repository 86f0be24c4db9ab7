"""Moving token rows for the experts: permutations, and zero-row padding of each expert's group on CPU.

Autograd answers ``x[index]`` with an accumulating scatter, which runs serially on CPU. Every move here
is a bijection onto its positions, so each backward is a plain gather (``index_select``) or an
``index_copy_`` into zeros: no accumulation.

Why pad on CPU: the grouped GEMM runs one matmul per expert, and oneDNN compiles a kernel for every
distinct matmul shape. It keeps the last 1,024 in a cache, at about 1 MiB each (measured: 1,500 bf16
matmuls [M, 512] x [512, 256] with M = 1..1,500 took 11.8 s and +1.07 GiB RSS the first time; a second
pass with a big enough cache took 5.2 s). An expert's row count changes every step, so each step made new
kernels: one small-v3-sparse forward+backward spent 3.7 s of 5.0 s in the grouped GEMM, 0.5 s once the
shapes repeated. Rounding every group up to a multiple of ``CPU_GROUP_ROWS`` with zero rows bounds the
distinct shapes (a few dozen per projection) at the price of at most ``CPU_GROUP_ROWS - 1`` extra rows
per expert. GPU grouped GEMMs do not compile per shape, so nothing is padded there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# rows per expert group are rounded up to this on CPU; 16 is also the row count of an AMX tile
CPU_GROUP_ROWS = 16
_padding_on = True


def group_rows_multiple(device: torch.device) -> int:
    """What every expert group's row count is rounded up to on ``device`` (1: no padding)."""
    return CPU_GROUP_ROWS if device.type == "cpu" and _padding_on else 1


@contextlib.contextmanager
def exact_group_rows() -> Iterator[None]:
    """Experts run on their exact row counts inside this block: FLOP counting (``observe/counting.py``)
    counts the model's work, not the padding's. Results are the same either way."""
    global _padding_on
    saved, _padding_on = _padding_on, False
    try:
        yield
    finally:
        _padding_on = saved


class PermuteRows(torch.autograd.Function):
    """``x[order]`` for a permutation ``order``; backward gathers by the inverse permutation.

    With this and the sum over slots in ``MoE.routed_experts``, one small-v3 MoE layer's
    forward+backward took 104.9 ms against 109.3 ms for ``x[token]`` and ``index_add_`` (bf16, 2
    threads, best of 21 alternating runs).
    """

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _spread(rows: torch.Tensor, pos: torch.Tensor, total: int) -> torch.Tensor:
    """A zero [total, ...] tensor with ``rows[i]`` at row ``pos[i]``."""
    return rows.new_zeros(total, *rows.shape[1:]).index_copy_(0, pos, rows)


class _SpreadRows(torch.autograd.Function):
    """Row i of ``x`` goes to row ``pos[i]`` of a zero [total, D] tensor (``pos`` distinct)."""

    @staticmethod
    def forward(ctx, x, pos, total: int):
        ctx.save_for_backward(pos)
        return _spread(x, pos, total)

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return grad.index_select(0, pos), None, None


class _PickRows(torch.autograd.Function):
    """Rows ``pos`` of ``x`` (``pos`` distinct); the rows left out get zero gradient."""

    @staticmethod
    def forward(ctx, x, pos):
        ctx.save_for_backward(pos)
        ctx.total = x.shape[0]
        return x.index_select(0, pos)

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return _spread(grad, pos, ctx.total), None


def padded_group_positions(counts_E: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For rows sorted by group with ``counts_E`` rows each: (row -> position once every group is
    rounded up to ``multiple`` rows, the rounded counts, their total)."""
    padded_E = (counts_E + multiple - 1) // multiple * multiple
    shift_E = (padded_E.cumsum(0) - padded_E) - (counts_E.cumsum(0) - counts_E)
    n = int(counts_E.sum())
    group = torch.repeat_interleave(torch.arange(counts_E.numel(), device=counts_E.device), counts_E,
                                    output_size=n)
    pos = torch.arange(n, device=counts_E.device) + shift_E[group]
    return pos, padded_E, int(padded_E.sum())


def run_padded_groups(fn, x_ND: torch.Tensor, counts_E: torch.Tensor, multiple: int) -> torch.Tensor:
    """``fn(x, counts)`` over rows sorted by group, run with every group padded by zero rows to a
    multiple of ``multiple``. ``fn`` must compute every row from that row alone (and its group): the
    padding rows' outputs are dropped and get zero gradient. Returns the rows for ``x_ND``'s rows."""
    pos, padded_E, total = padded_group_positions(counts_E, multiple)
    return _PickRows.apply(fn(_SpreadRows.apply(x_ND, pos, total), padded_E), pos)
