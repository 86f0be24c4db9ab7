"""The plain GPT's config: its own dataclass (no DeepSeek field), with the family-neutral names the
planner and the FLOP counter read (docs/architecture.md, "How to add a model family", item 1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from seektrain.errors import UserError

ARCH = "plain_gpt"


@dataclass(frozen=True)
class GPTConfig:
    name: str = "gpt-tiny"
    arch: str = ARCH
    vocab_size: int = 128
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 64
    intermediate_size: int = 256  # the GELU MLP's width (GPT-2: 4 x hidden_size)
    layer_norm_eps: float = 1e-5

    # what generic code asks of every family's config: a dense model without MTP or tied embeddings
    num_nextn_predict_layers = 0
    num_experts_per_tok = 0
    is_moe = False
    tie_word_embeddings = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    qk_head_dim = value_head_dim = head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return False

    def validate(self) -> GPTConfig:
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, key) <= 0:
                raise UserError(f"model config {self.name!r}: {key} must be positive")
        if self.hidden_size % self.num_attention_heads:
            raise UserError(f"model config {self.name!r}: hidden_size must divide into the heads")
        return self

    def replace(self, **changes) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GPTConfig:
        return cls(**data).validate()
