"""Under autocast the experts give the autocast dtype whether a rank received tokens or none: expert
parallelism's return all-to-all failed with a size mismatch when one rank's empty batch (padded-bmm
path, autocast) came back bf16 while another's (grouped GEMM, not autocast) came back fp32."""

from __future__ import annotations

import pytest
import torch

from seektrain.models.deepseek.moe import grouped_swiglu


@pytest.mark.parametrize("tokens", [0, 5])
def test_grouped_swiglu_output_dtype_follows_autocast(tokens):
    experts, dim, hidden = 4, 16, 8
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * hidden, dim, generator=gen)
    down = torch.randn(experts, dim, hidden, generator=gen)
    x = torch.randn(tokens, dim, generator=gen)
    counts = torch.tensor([tokens, 0, 0, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_swiglu(x, counts, gate_up, down)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, dim)
    assert grouped_swiglu(x, counts, gate_up, down).dtype == torch.float32
