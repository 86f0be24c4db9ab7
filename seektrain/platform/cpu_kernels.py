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
per expert. GPU grouped GEMMs do not compile per shape, so the generic kernels pad nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seektrain.models.kernels import Kernels, causal_attention

# rows per expert group are rounded up to this; 16 is also the row count of an AMX tile
CPU_GROUP_ROWS = 16


def value_padded_attention(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor,
                           scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_attention`` with v zero-padded to q's head size when it is smaller (see above). Packed
    rows keep the boolean document mask (``Kernels.document_mask``'s default): FlexAttention has no
    backward on the CPU."""
    v_dim, qk_dim = v_BHTV.shape[-1], q_BHTK.shape[-1]
    if v_dim >= qk_dim:
        return causal_attention(q_BHTK, k_BHTK, v_BHTV, scale, mask)
    return causal_attention(q_BHTK, k_BHTK, F.pad(v_BHTV, (0, qk_dim - v_dim)), scale, mask)[..., :v_dim]


def cpu_kernels() -> Kernels:
    return Kernels(attention=value_padded_attention, expert_row_multiple=CPU_GROUP_ROWS)
