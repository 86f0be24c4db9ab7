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

from seektrain.models.attention import build_attention
from seektrain.models.config import ModelConfig
from seektrain.models.init import init_weights
from seektrain.models.kernels import Kernels
from seektrain.models.layers import RMSNorm, SwiGLU, rope_cos_sin
from seektrain.models.linear_cross_entropy import linear_cross_entropy, shift_labels
from seektrain.models.moe import MoE, Router


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: Kernels | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = build_attention(cfg, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (MoE(cfg, kernels) if cfg.is_moe_layer(layer_idx)
                    else SwiGLU(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, h_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos, sin)
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

    def forward(self, h_BTD, emb_BTD, cos, sin) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1))
        return self.block(x, cos, sin)


class HeadLosses(NamedTuple):
    """Cross-entropy summed over labelled tokens: the next-token head, then each MTP depth."""

    main: torch.Tensor
    mtp: list[torch.Tensor]


class Transformer(nn.Module):
    """``model(tokens)`` -> logits [B, T, V]; ``model(tokens, mtp_labels=labels)`` -> (logits, MTP depth 1
    logits, ...): a flat tuple of tensors, so a pipeline's last stage can return it as it is.

    ``mtp_labels`` are the next-token labels of ``tokens`` (labels[:, i] == tokens[:, i+1]); MTP depth k
    reads labels shifted by k-1 as its input tokens and is trained on labels shifted by k.

    ``model(tokens, labels=labels[, mtp_labels=labels])`` -> ``HeadLosses``: the training path. The head
    and its cross-entropy run fused (models/linear_cross_entropy.py), so the [B, T, V] logits are never
    returned; it needs the plain (not vocabulary-sharded) head.

    ``kernels``: the attention and expert computations to use (``models/kernels.py``; default: plain).
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, kernels)
                                     for i in range(cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.num_hidden_layers + k, kernels)
                                 for k in range(cfg.num_nextn_predict_layers))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, mtp_labels: torch.Tensor | None = None,
                labels: torch.Tensor | None = None):
        """``tokens`` are token ids, or the hidden states [B, T, D] of the previous pipeline stage when this
        model has no embedding; likewise ``mtp_labels`` are label ids or, past the first stage, their
        embeddings. Without a final norm (not the last stage) the result is the hidden states, and the
        label embeddings too when MTP needs them downstream: ``h`` or ``(h, label embeddings)``."""
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        label_emb = None
        if mtp_labels is not None and self.cfg.num_nextn_predict_layers > 0:
            label_emb = self.embed_tokens(mtp_labels) if self.embed_tokens is not None else mtp_labels
        cos, sin = rope_cos_sin(self.cfg, h.shape[1], h.device, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is None:
            return h if label_emb is None else (h, label_emb)
        if labels is not None:
            main = self._head_loss(self.norm(h), labels)
            mtp = self.mtp_logits(h, label_emb, cos, sin, labels) if label_emb is not None else []
            return HeadLosses(main, mtp)
        logits = self.lm_head(self.norm(h))
        if label_emb is None:
            return logits
        return (logits, *self.mtp_logits(h, label_emb, cos, sin))

    def _head_loss(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h_BTD.flatten(0, 1), self.lm_head.weight, labels_BT.flatten())

    def mtp_logits(self, h_BTD: torch.Tensor, label_emb_BTD: torch.Tensor, cos, sin,
                   labels_BT: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Logits of every MTP depth from the main model's last hidden state and the embeddings of the
        next-token labels (computed once; depth k+1 reads them shifted left by k). With ``labels_BT``
        each depth's summed cross-entropy instead of its logits."""
        out = []
        for k, module in enumerate(typing.cast(list[MTPModule], self.mtp)):
            # Depth k+1 sees token i+k+1 == label i+k; positions past the end repeat the last label
            # and are masked out of the loss.
            shifted = torch.cat([label_emb_BTD[:, k:], label_emb_BTD[:, -1:].expand(-1, k, -1)], dim=1)
            h_BTD = module(h_BTD, shifted, cos, sin)
            if labels_BT is None:
                out.append(self.lm_head(module.norm(h_BTD)))
            else:
                out.append(self._head_loss(module.norm(h_BTD), shift_labels(labels_BT, k + 1)))
        return out

    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter, identically whatever the sharding (see models/init.py);
        called after ``to_empty`` when the model was built on the meta device."""
        init_weights(self, self.cfg.initializer_range, seed)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                init: bool = True, seed: int = 0, kernels: Kernels | None = None) -> Transformer:
    """Build on ``device`` ("meta" costs no memory for any size; call ``init_weights`` after ``to_empty``).
    ``kernels``: the platform's (``seektrain.platform.policy_for(device).model_kernels()``) for training;
    the default, plain ones count FLOPs exactly and serve as the reference."""
    cfg.validate()
    with torch.device(device):
        model = Transformer(cfg, kernels)
    if dtype != torch.float32:
        model.to(dtype)
        for module in model.modules():  # the balancing bias accumulates tiny updates: keep it fp32
            if isinstance(module, Router) and module.e_score_correction_bias is not None:
                module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    if init and torch.device(device).type != "meta":
        model.init_weights(seed)
    return model
