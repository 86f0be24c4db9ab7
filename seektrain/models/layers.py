"""Building blocks shared by every DeepSeek model: RMSNorm, the SwiGLU MLP and rotary embeddings.

Shape letters used in this package: B batch, T sequence, D hidden size, H heads, K head dim,
E experts, N routed token slots, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """The dense feed-forward block (and DeepSeekMoE's shared experts): down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------- rotary embeddings
def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin magnitude (YaRN's attention factor)."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    rs = cfg.rope_scaling
    if rs is None or rs.factor <= 1.0:
        return inv_freq, 1.0
    if rs.type != "yarn":
        raise UserError(f"rope_scaling.type={rs.type!r} is not supported; only 'yarn' is")

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp
    inv_freq = (inv_freq / rs.factor) * (1 - extrapolation) + inv_freq * extrapolation
    if rs.mscale and rs.mscale_all_dim:
        factor = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    else:
        factor = yarn_mscale(rs.factor)
    return inv_freq, float(factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(head dim), corrected by mscale_all_dim^2 under YaRN (DeepSeek-V2/V3)."""
    scale = cfg.qk_head_dim**-0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.factor > 1.0 and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


def rope_cos_sin(
    cfg: ModelConfig, seq_len: int, device, dtype, positions_BT: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, rope_dim/2] for positions 0 .. T-1, or [B, 1, T, rope_dim/2] gathered per token
    from ``positions_BT`` (packed rows, where positions restart at each document; the 1 broadcasts over
    heads). Computed per call (cheap), so no buffer needs re-initialising."""
    inv_freq, magnitude = rope_inv_freq(cfg, device)
    if positions_BT is None:
        freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    else:
        freqs = (positions_BT.to(torch.float32)[..., None] * inv_freq).unsqueeze(1)
    return (freqs.cos() * magnitude).to(dtype), (freqs.sin() * magnitude).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, H, T, R]. Interleaved pairs (x0,x1),(x2,x3).. for MLA, rotate-half for Llama.

    The interleaved form returns its halves de-interleaved; q and k get the same permutation,
    so attention scores are unchanged.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
