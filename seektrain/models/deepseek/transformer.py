"""The DeepSeek decoder-only transformer, with optional multi-token prediction (MTP) modules.

The model is a plain ``nn.Module`` and knows nothing of parallelism. Parallel wrappers (FSDP, TP,
pipeline stages) are applied from outside. To make pipeline splitting easy (as torchtitan does), layers
live in a ``ModuleDict`` keyed by their global index and the forward accepts missing parts: a pipeline
stage is this class with the layers it does not own deleted and without the embedding (not the first
stage) or the final norm, head and MTP modules (not the last stage) (seektrain/parallel/pipeline.py).
"""

from __future__ import annotations

import typing
from typing import NamedTuple

import torch
from torch import nn

from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.attention import build_attention
from seektrain.models.deepseek.init import init_weights
from seektrain.models.deepseek.kv_cache import DecodeCache, LayerCache
from seektrain.models.deepseek.moe import MoE, Router
from seektrain.models.kernels import Kernels
from seektrain.models.layers import RMSNorm, SwiGLU, rope_cos_sin
from seektrain.models.linear_cross_entropy import head_target, linear_cross_entropy


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: Kernels | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = build_attention(cfg, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (
            MoE(cfg, kernels)
            if cfg.is_moe_layer(layer_idx)
            else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self,
        h_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask=None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos, sin, mask, cache=cache)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


class MTPModule(nn.Module):
    """One multi-token-prediction depth: combine the previous depth's hidden state at position i with the
    embedding of token i+k, run one decoder block, and predict token i+k+1 with the shared output head."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: Kernels | None = None):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, layer_idx, kernels)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h_BTD, emb_BTD, cos, sin, mask=None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1))
        return self.block(x, cos, sin, mask)


class ModelOutput(NamedTuple):
    """What ``Transformer.forward`` returns, whatever it was asked; the parts it was not asked for are
    ``None`` or empty.

    * ``logits`` [B, T, V]: the next-token logits (no ``labels`` given).
    * ``loss_sum``: the next-token cross-entropy summed over the trained tokens (``labels`` given; the
      fused head, models/linear_cross_entropy.py).
    * ``mtp``: per MTP depth, its logits or (with ``labels``) its summed cross-entropy.
    * ``hidden``: a pipeline stage without the head: the hidden states [B, T, D], and the embeddings of
      the MTP tokens when MTP needs them downstream. They are the next stage's positional inputs; the
      pipeline sends this tuple of tensors (``parallel/pipeline.py``).

    A ``NamedTuple`` so that the pipeline schedule can merge its tensors across micro-batches.
    """

    logits: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    mtp: tuple[torch.Tensor, ...] = ()
    hidden: tuple[torch.Tensor, ...] = ()


class Transformer(nn.Module):
    """``model(tokens)`` -> ``ModelOutput(logits=...)``; with ``mtp_tokens=tokens`` also each MTP depth's
    logits. MTP depth k at position i reads token i+k (``mtp_tokens`` shifted by k) and predicts token
    i+k+1.

    ``mtp_tokens`` may also be each depth's input tokens already [B, T, depths], and ``labels`` each
    head's targets [B, T, 1 + depths] (``data/batch.py``: context parallelism's chunks are not
    contiguous, so it shifts whole rows before splitting them).

    ``model(tokens, labels=labels[, mtp_tokens=tokens])`` -> ``ModelOutput(loss_sum=..., mtp=...)``: the
    training path. The head and its cross-entropy run fused (models/linear_cross_entropy.py), so the
    [B, T, V] logits are never returned; it needs the plain (not vocabulary-sharded) head.

    Packed rows (``data/batch.py``): ``positions`` [B, T] drive RoPE (restarting at each document) and
    ``document_ids`` [B, T] make attention causal within each document only; MTP is trained only where
    the token it predicts is in the same document (``shift_labels``). Both ``None`` (the default) is
    one document per row at positions 0 .. T-1: the plain causal path, unchanged.

    ``kernels``: the attention and expert computations to use (``models/kernels.py``; default: plain).

    Decoding (``train/decode.py``): ``model(tokens, cache=model.init_cache(...))`` runs only the new
    tokens against what the cache holds of the earlier ones (``models/deepseek/kv_cache.py``), which
    then gives their positions and mask; no MTP, no labels. Without a cache nothing of it runs.
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels or Kernels()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, i, kernels) for i in range(cfg.num_hidden_layers)}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            MTPModule(cfg, cfg.num_hidden_layers + k, kernels) for k in range(cfg.num_nextn_predict_layers)
        )
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        tokens: torch.Tensor,
        mtp_tokens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: DecodeCache | None = None,
    ) -> ModelOutput:
        """``tokens`` are token ids, or the hidden states [B, T, D] of the previous pipeline stage when this
        model has no embedding; likewise ``mtp_tokens`` are token ids or, past the first stage, their
        embeddings. Without a final norm (not the last stage) only ``hidden`` is filled."""
        if cache is not None:
            return self._decode(tokens, cache)
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        mtp_emb = None
        if mtp_tokens is not None and self.cfg.num_nextn_predict_layers > 0:
            mtp_emb = self.embed_tokens(mtp_tokens) if self.embed_tokens is not None else mtp_tokens
        cos, sin = rope_cos_sin(self.cfg, h.shape[1], h.device, h.dtype, positions)
        mask = None if document_ids is None else self.kernels.document_mask(document_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is None:
            return ModelOutput(hidden=(h,) if mtp_emb is None else (h, mtp_emb))
        mtp = self._mtp(h, mtp_emb, cos, sin, mask, labels, document_ids) if mtp_emb is not None else ()
        if labels is None:
            return ModelOutput(logits=self.lm_head(self.norm(h)), mtp=mtp)
        return ModelOutput(loss_sum=self._head_loss(self.norm(h), head_target(labels, 0)), mtp=mtp)

    def _decode(self, tokens_BT: torch.Tensor, cache: DecodeCache) -> ModelOutput:
        """The logits of the new tokens ``tokens_BT``, each layer reading and extending its cache."""
        T = tokens_BT.shape[1]
        h = self.embed_tokens(tokens_BT)
        cos, sin = rope_cos_sin(self.cfg, T, h.device, h.dtype, cache.positions(T))
        mask = cache.mask(T)
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, mask, cache.layers[name])
        cache.advance(T)
        return ModelOutput(logits=self.lm_head(self.norm(h)))

    def init_cache(self, batch: int, max_len: int, pads_B: torch.Tensor | None = None) -> DecodeCache:
        """An empty KV cache for ``batch`` rows of up to ``max_len`` slots, in the model's dtype and on its
        device; ``pads_B``: each row's left padding (none by default)."""
        weight = self.embed_tokens.weight
        layers = {
            name: typing.cast(DecoderLayer, layer).self_attn.new_cache(
                batch, max_len, weight.dtype, weight.device
            )
            for name, layer in self.layers.items()
        }
        pads = torch.zeros(batch, dtype=torch.long) if pads_B is None else pads_B
        return DecodeCache(layers, pads.to(weight.device), max_len)

    def _head_loss(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h_BTD.flatten(0, 1), self.lm_head.weight, labels_BT.flatten())

    def _mtp(
        self,
        h_BTD: torch.Tensor,
        emb_BTD: torch.Tensor,
        cos,
        sin,
        mask,
        labels_BT: torch.Tensor | None,
        document_ids_BT: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """Each MTP depth's logits from the main model's last hidden state and the embeddings of the MTP
        tokens (computed once; depth k reads them shifted left by k, or its own [B, T, depths, D] slice);
        with ``labels_BT`` its summed cross-entropy instead."""
        out = []
        for depth, module in enumerate(typing.cast(list[MTPModule], self.mtp), start=1):
            if emb_BTD.dim() == 4:  # each depth's tokens, shifted on the whole row (context parallelism)
                shifted = emb_BTD[:, :, depth - 1]
            else:  # positions past the end repeat the last token; their targets are past the end: ignored
                shifted = torch.cat([emb_BTD[:, depth:], emb_BTD[:, -1:].expand(-1, depth, -1)], dim=1)
            h_BTD = module(h_BTD, shifted, cos, sin, mask)
            if labels_BT is None:
                out.append(self.lm_head(module.norm(h_BTD)))
            else:
                out.append(
                    self._head_loss(module.norm(h_BTD), head_target(labels_BT, depth, document_ids_BT))
                )
        return tuple(out)

    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter, identically whatever the sharding (see models/deepseek/init.py);
        called after ``to_empty`` when the model was built on the meta device."""
        init_weights(self, self.cfg.initializer_range, seed)


def keep_fp32_buffers(model: nn.Module) -> None:
    """After ``model.to(low dtype)``: the balancing bias accumulates tiny updates, so it stays fp32."""
    for module in model.modules():
        if isinstance(module, Router) and module.e_score_correction_bias is not None:
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
