"""The model kernels of the CPU policy: value padding for MLA attention, zero-row padding of expert groups.

Both give the plain kernels' outputs and gradients (``tests/test_platform.py``); only their speed on CPU
differs.

**Value padding.** PyTorch's CPU flash-attention kernel is 3x faster than the math fallback (forward and
backward) but needs one head size for q, k and v. MLA's ``v_head_dim`` is below its query/key head size,
so v is zero-padded to it; the padded output columns are exactly zero and are sliced off. (FLOP counters
see the extra P·V work, which is why FLOP counting builds its model with the plain kernels.)

**Expert rows.** The grouped GEMM runs one matmul per expert, and oneDNN compiles a kernel for every
distinct matmul shape. It keeps the last 1,024 in a cache, at about 1 MiB each (measured: 1,500 bf16
matmuls [M, 512] x [512, 256] with M = 1..1,500 took 11.8 s and +1.07 GiB RSS the first time; a second
pass with a big enough cache took 5.2 s). An expert's row count changes every step, so each step made new
kernels: one small-v3-sparse forward+backward spent 3.7 s of 5.0 s in the grouped GEMM, 0.5 s once the
shapes repeated. Rounding every group up to a multiple of ``CPU_GROUP_ROWS`` with zero rows bounds the
distinct shapes (a few dozen per projection) at the price of at most ``CPU_GROUP_ROWS - 1`` extra rows
per expert. GPU grouped GEMMs do not compile per shape, so the generic kernels pad nothing, and neither
does an fp32 run on CPU: its matmuls are MKL's sgemm, which compiles nothing per shape, so the padding
is pure extra work there (one fp32 expert layer's forward+backward, 16 experts, 4,096 slots, 1 thread,
interleaved, shared machine: 1.99 s padded vs 1.73 s plain; under the AVX2 emulation 2.27 vs 2.04 s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seektrain.models.kernels import Kernels, causal_attention

# rows per expert group are rounded up to this; 16 is also the row count of an AMX tile
CPU_GROUP_ROWS = 16


def value_padded_attention(
    q_BHTK: torch.Tensor,
    k_BHTK: torch.Tensor,
    v_BHTV: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``causal_attention`` with v zero-padded to q's head size when it is smaller (see above). Packed
    rows keep the boolean document mask (``Kernels.document_mask``'s default): FlexAttention has no
    backward on the CPU."""
    v_dim, qk_dim = v_BHTV.shape[-1], q_BHTK.shape[-1]
    if v_dim >= qk_dim:
        return causal_attention(q_BHTK, k_BHTK, v_BHTV, scale, mask)
    return causal_attention(q_BHTK, k_BHTK, F.pad(v_BHTV, (0, qk_dim - v_dim)), scale, mask)[..., :v_dim]


def cpu_kernels(compute_dtype: torch.dtype = torch.bfloat16) -> Kernels:
    """The CPU kernels for a model computing in ``compute_dtype``: expert rows padded only where oneDNN
    runs the matmuls (bf16, fp16), the value padding always (flash beats the math fallback in fp32 as
    well: 1.17 vs 1.58 s for small-v3's attention forward+backward, 1.26 vs 1.41 s under the AVX2
    emulation; docs/benchmarks.md)."""
    rows = 1 if compute_dtype == torch.float32 else CPU_GROUP_ROWS
    return Kernels(attention=value_padded_attention, expert_row_multiple=rows)
