"""Moving token rows for the experts: permutations, and zero-row padding of each expert's group.

Autograd answers ``x[index]`` with an accumulating scatter, which runs serially on CPU. Every move here
is a bijection onto its positions, so each backward is a plain gather (``index_select``) or an
``index_copy_`` into zeros: no accumulation.

The padding runs when the model's ``Kernels.expert_row_multiple`` is above 1 (the CPU policy's choice,
with its measurements, is in ``seektrain/platform/cpu_kernels.py``); it changes no output or gradient.
"""

from __future__ import annotations

import torch


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
    group = torch.repeat_interleave(
        torch.arange(counts_E.numel(), device=counts_E.device), counts_E, output_size=n
    )
    pos = torch.arange(n, device=counts_E.device) + shift_E[group]
    return pos, padded_E, int(padded_E.sum())


def run_padded_groups(fn, x_ND: torch.Tensor, counts_E: torch.Tensor, multiple: int) -> torch.Tensor:
    """``fn(x, counts)`` over rows sorted by group, run with every group padded by zero rows to a
    multiple of ``multiple``. ``fn`` must compute every row from that row alone (and its group): the
    padding rows' outputs are dropped and get zero gradient. Returns the rows for ``x_ND``'s rows."""
    pos, padded_E, total = padded_group_positions(counts_E, multiple)
    return _PickRows.apply(fn(_SpreadRows.apply(x_ND, pos, total), padded_E), pos)
