"""Row moves of the MoE dispatch: padding each expert's rows (the CPU kernels') changes no output and no
gradient."""

import pytest
import torch

from seektrain.models.deepseek import moe
from seektrain.models.deepseek.moe_rows import PermuteRows, padded_group_positions
from seektrain.models.kernels import Kernels
from seektrain.platform import policy_for
from tolerances import fp32_matmul_tol


def test_padded_positions_round_every_group_up():
    counts = torch.tensor([3, 0, 17, 16, 1])
    pos, padded, total = padded_group_positions(counts, 16)
    assert padded.tolist() == [16, 0, 32, 16, 16] and total == 80
    # group starts in the padded layout: 0, 16, 16, 48, 64
    expected = [0, 1, 2] + list(range(16, 33)) + list(range(48, 64)) + [64]
    assert pos.tolist() == expected


def test_permute_rows_backward_is_the_inverse_permutation():
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    order = torch.tensor([4, 0, 5, 1, 3, 2])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(6)
    assert torch.autograd.gradcheck(lambda t: PermuteRows.apply(t, order, inverse), (x,))


def _swiglu_outputs(counts, row_multiple: int, dtype, grouped: bool = True):
    """grouped_swiglu's output and gradients on fixed data, each expert's rows padded to ``row_multiple``."""
    gen = torch.Generator().manual_seed(0)
    E, D, F = counts.numel(), 32, 24
    x = torch.randn(int(counts.sum()), D, generator=gen).to(dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * F, D, generator=gen) / D**0.5).to(dtype).requires_grad_()
    down = (torch.randn(E, D, F, generator=gen) / F**0.5).to(dtype).requires_grad_()
    kernels = Kernels(
        expert_row_multiple=row_multiple, grouped_mm_dtypes=Kernels().grouped_mm_dtypes if grouped else ()
    )
    out = moe.grouped_swiglu(x, counts, gate_up, down, kernels)
    out.backward(torch.randn(out.shape, generator=gen).to(dtype))
    return [t.detach().float() for t in (out, x.grad, gate_up.grad, down.grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_group_padding_changes_no_output_or_gradient(dtype):
    assert (
        policy_for(torch.device("cpu")).model_kernels().grouped_mm_covers(torch.zeros(1, dtype=dtype), 48, 32)
    )
    counts = torch.tensor([5, 0, 17, 16, 1, 40])  # empty, below, at and above a multiple of 16
    multiple = policy_for(torch.device("cpu")).model_kernels().expert_row_multiple
    assert multiple == 16
    padded = _swiglu_outputs(counts, multiple, dtype)
    plain = _swiglu_outputs(counts, 1, dtype)
    # fp32: padded groups (and the batched matmul) block each product differently, so the sums' order
    # differs; the tolerance follows the longest chain of reductions (forward D then F, backward 2F, the
    # weight gradients over an expert's rows) and each tensor's scale
    k = 32 + 2 * 24 + int(counts.max())

    def tol(b):
        return fp32_matmul_tol(k, b.abs().max()) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)

    for a, b, name in zip(padded, plain, ["output", "x grad", "gate_up grad", "down grad"]):
        torch.testing.assert_close(a, b, **tol(b), msg=lambda m, n=name: f"{n}: {m}")
    # and the batched-matmul reference (no grouped GEMM) agrees in fp32
    if dtype == torch.float32:
        reference = _swiglu_outputs(counts, multiple, dtype, grouped=False)
        for a, b in zip(padded, reference):
            torch.testing.assert_close(a, b, **tol(b))
