"""Causal self-attention: grouped-query attention (DeepSeek-LLM) and multi-head latent attention (V2/V3).

Both run through ``Kernels.attention`` (``F.scaled_dot_product_attention`` by default) so the fastest
kernel of the platform is used. ``cos``/``sin`` are RoPE's tables, per position or per token of packed
rows (``layers.rope_cos_sin``); ``mask`` is ``None`` (plain causal) or the document mask the model built
once per forward with ``Kernels.document_mask`` (causal within each document of a packed row).
With a ``cache`` (decoding, ``models/deepseek/kv_cache.py``) the new tokens' keys join the cached ones and
``mask`` is the cache's boolean mask over them; that path runs torch's plain attention, whose boolean
mask a platform kernel (FlexAttention's block masks) would not take.
Head counts are read from the weight shapes at run time, so tensor parallelism (which shards the
projections over heads) needs no change here.
"""

from __future__ import annotations

import torch
from torch import nn

from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.kv_cache import LayerCache
from seektrain.models.kernels import Kernels, causal_attention
from seektrain.models.layers import RMSNorm, apply_rope, softmax_scale
from seektrain.models.lora import adapted_weight

PLAIN_KERNELS = Kernels()  # the cached path's attention: a boolean mask over the cached keys


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernels: Kernels, mask
) -> torch.Tensor:
    """q [B,H,T,K], k [B,Hkv,T,K], v [B,Hkv,T,Kv] -> [B,T,H*Kv]; ``mask``: see ``Kernels``."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return kernels.attention(q, k, v, scale, mask).transpose(1, 2).flatten(2)


class GQAttention(nn.Module):
    """Llama-style attention with rotate-half RoPE; MHA when num_key_value_heads == num_attention_heads."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.kernels = kernels or Kernels()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=cfg.attention_bias)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask=None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, interleaved=False), apply_rope(k, cos, sin, interleaved=False)
        if cache is None:
            return self.o_proj(_attend(q, k, v, self.scale, self.kernels, mask))
        k_BSHK, v_BSHK = cache.append(k.transpose(1, 2), v.transpose(1, 2))
        out = _attend(q, k_BSHK.transpose(1, 2), v_BSHK.transpose(1, 2), self.scale, PLAIN_KERNELS, mask)
        return self.o_proj(out)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> LayerCache:
        """The rotated keys and the values of this layer's key/value heads, [batch, max_len, Hkv, K]
        each: ``2 * Hkv * K`` elements per token."""
        heads = self.k_proj.out_features // self.head_dim
        shape = (batch, max_len, heads, self.head_dim)
        return LayerCache(
            torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        )


class MLAttention(nn.Module):
    """Multi-head latent attention: queries (optionally) and keys/values pass through low-rank latents;
    a small decoupled key carries RoPE and is shared by all heads."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.kernels = kernels or Kernels()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        assert cfg.kv_lora_rank is not None  # an MLA config (cfg.is_mla)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = softmax_scale(cfg)
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=cfg.attention_bias)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask=None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q = q.view(B, T, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)

        kv_latent, k_rot = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope], dim=-1)
        if cache is not None:
            q_rot = apply_rope(q_rot, cos, sin, interleaved=True)
            k_rot = apply_rope(k_rot.view(B, 1, T, self.rope), cos, sin, interleaved=True)
            (keys_BSC,) = cache.append(torch.cat([self.kv_a_layernorm(kv_latent), k_rot[:, 0]], dim=-1))
            return self._absorbed(q_nope, q_rot, keys_BSC, mask)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(B, T, -1, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        heads = q.shape[1]

        q_rot = apply_rope(q_rot, cos, sin, interleaved=True)
        k_rot = apply_rope(k_rot.view(B, 1, T, self.rope), cos, sin, interleaved=True)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, heads, T, self.rope)], dim=-1)
        return self.o_proj(_attend(q, k, v, self.scale, self.kernels, mask))

    def _absorbed(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, keys_BSC: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention over cached latents without up-projecting them. ``kv_b_proj`` maps the latent c to
        each head's key part ``W_UK c`` and value ``W_UV c``, so ``q_nope . W_UK c = (W_UK^T q_nope) . c``:
        the query goes down into the latent space, the scores read the latents (and the rotated keys)
        directly, and the weighted sum of latents goes up through ``W_UV`` once per query.
        ``keys_BSC`` [B, S, kv_lora_rank + rope] are the cached normed latents then rotated keys."""
        B, H = q_nope.shape[:2]
        S, rank = keys_BSC.shape[1], self.kv_lora_rank
        w = adapted_weight(self.kv_b_proj).to(q_nope.dtype).view(H, self.nope + self.v_dim, rank)
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w[:, : self.nope])
        q = torch.cat([q_latent, q_rot], dim=-1)
        k = keys_BSC.unsqueeze(1).expand(B, H, S, keys_BSC.shape[-1])
        v = keys_BSC[..., :rank].unsqueeze(1).expand(B, H, S, rank)
        out_latent = causal_attention(q, k, v, self.scale, mask)  # [B, H, T, rank]
        out = torch.einsum("bhtc,hvc->bthv", out_latent, w[:, self.nope :]).flatten(2)
        return self.o_proj(out)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> LayerCache:
        """The normed latent then the rotated decoupled key, [batch, max_len, kv_lora_rank + rope]:
        ``kv_lora_rank + qk_rope_head_dim`` elements per token, whatever the head count."""
        shape = (batch, max_len, self.kv_lora_rank + self.rope)
        return LayerCache(torch.zeros(shape, dtype=dtype, device=device))


def build_attention(cfg: ModelConfig, kernels: Kernels | None = None) -> MLAttention | GQAttention:
    return MLAttention(cfg, kernels) if cfg.is_mla else GQAttention(cfg, kernels)
