"""Next-token logits for a batch of prompts as it grows by one token per row per step, with the KV cache
(the prompt is run once, then each step runs one token per row) or without it (each step reruns the
whole sequence: the reference the cache is tested and benchmarked against).

Prompts of different lengths are left-padded to one length, so every row's next token is in the same
column. A row's pads are masked out and its RoPE positions start at its first real token, so it decodes
as it would alone: with the cache through ``DecodeCache``'s positions and mask, without it as a packed
row of two documents (the pads, then the real tokens; ``Transformer.forward``'s ``positions`` and
``document_ids``).

Past the model's context (``max_position_embeddings``) the window slides: each step reruns the last
``max_position_embeddings`` tokens, with the cache or not (a cache holds no more positions than that).
"""

from __future__ import annotations

import torch

from seektrain.models import Transformer

PAD_ID = 0  # what fills a pad slot; never attended, so any id would do


class Decoder:
    """``first()``: the logits [B, V] after each prompt; ``step(tokens_B)``: feed one token per row,
    get the logits after it. ``use_cache=False`` reruns the sequence at every step."""

    def __init__(
        self, model: Transformer, prompts: list[list[int]], max_new_tokens: int, use_cache: bool = True
    ):
        self.model, self.limit = model, model.cfg.max_position_embeddings
        longest = max(len(p) for p in prompts)
        self.pads = torch.tensor([longest - len(p) for p in prompts], dtype=torch.long)
        self.ids = torch.tensor([[PAD_ID] * (longest - len(p)) + list(p) for p in prompts], dtype=torch.long)
        room = min(longest + max_new_tokens, self.limit)
        self.cache = (
            model.init_cache(len(prompts), room, self.pads) if use_cache and longest <= room else None
        )

    def first(self) -> torch.Tensor:
        if self.cache is not None:
            return self._last(self.model(self.ids, cache=self.cache).logits)
        return self._rerun()

    def step(self, tokens_B: torch.Tensor) -> torch.Tensor:
        self.ids = torch.cat([self.ids, tokens_B.view(-1, 1).to(self.ids.dtype)], dim=1)
        if self.cache is not None and self.cache.length < self.cache.max_len:
            return self._last(self.model(self.ids[:, -1:], cache=self.cache).logits)
        self.cache = None  # full: slide the window from here on
        return self._rerun()

    def _rerun(self) -> torch.Tensor:
        """The last position's logits over the whole window, recomputed."""
        window = self.ids[:, -self.limit :]
        pads = (self.pads - (self.ids.shape[1] - window.shape[1])).clamp(min=0)
        if not bool(pads.any()):
            return self._last(self.model(window).logits)
        slots = torch.arange(window.shape[1])[None, :]
        real = slots >= pads[:, None]
        positions = (slots - pads[:, None]).clamp(min=0)
        return self._last(self.model(window, positions=positions, document_ids=real.long()).logits)

    @staticmethod
    def _last(logits_BTV: torch.Tensor) -> torch.Tensor:
        return logits_BTV[:, -1].float()
