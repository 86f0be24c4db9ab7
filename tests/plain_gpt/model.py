"""A small plain GPT (GPT-2's shape): learned absolute positions, multi-head attention, a GELU MLP,
pre-LayerNorm blocks, untied head. Plain PyTorch that knows nothing of parallelism: every reshape takes
the head count from the tensor (``-1``), so the same code runs on a tensor-parallel rank's heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plain_gpt.config import GPTConfig
from seektrain.models import ModelOutput
from seektrain.models.deepseek.init import deterministic_normal_  # the layout-independent init

INIT_STD = 0.02


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d) for _ in range(3))
        self.o_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class PlainGPT(nn.Module):
    """``model(tokens)`` -> ``ModelOutput(logits=...)``. ``labels`` (the trainer's offer of a fused head) is
    declined: the logits come back and ``model_loss`` takes the cross-entropy. MTP tokens, packed
    positions and documents do not apply and must be ``None``."""

    def __init__(self, cfg: GPTConfig, kernels=None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_hidden_layers)})
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, **unused) -> ModelOutput:
        given = [k for k, v in unused.items() if v is not None]
        if given:
            raise ValueError(f"PlainGPT takes no {', '.join(given)}")
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embed_tokens(tokens) + self.embed_positions(positions)
        for layer in self.layers.values():
            x = layer(x)
        return ModelOutput(logits=self.lm_head(self.norm(x)))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """GPT-2's init (normal 0.02, zero biases, unit LayerNorm), the same on any layout."""
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                deterministic_normal_(param, INIT_STD, seed, name)
