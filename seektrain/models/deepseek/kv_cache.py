"""The KV cache of decoding: what each attention layer keeps of the positions already seen, so that a
new token costs one position's work instead of the whole sequence's.

What a layer keeps is its attention's choice (``GQAttention.new_cache``, ``MLAttention.new_cache``):
GQA/MHA keeps the rotated keys and the values of its key/value heads, MLA the normed latent and the
rotated decoupled key (DeepSeek's absorbed form; its queries and outputs go through ``kv_b_proj``'s
halves instead of up-projecting the cached positions). ``LayerCache`` holds those preallocated
[batch, max_len, ...] tensors and how many positions are filled; ``DecodeCache`` holds every layer's and
what is common to them: the left padding of each row, hence the RoPE positions of new tokens and the
attention mask over the cached keys.

Rows of a batch are left-padded to one length: row b's real tokens start at slot ``pads[b]`` and its
RoPE positions at 0 there, so a row decodes as it would alone. Pad slots are never attended, except by
the pad itself (a query with no key at all would be NaN; a pad's output is never read).
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's cached tensors, each [batch, max_len, ...], and ``length``: the slots filled."""

    def __init__(self, *buffers: torch.Tensor):
        self.buffers = buffers
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.buffers[0].shape[1]

    def bytes_per_token(self) -> int:
        """Bytes this layer keeps per position of one row."""
        return sum(b[0, 0].numel() * b.element_size() for b in self.buffers)

    def append(self, *new_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write the new positions' tensors ([batch, T, ...], one per buffer) after the filled ones;
        return every buffer's filled part [batch, length, ...] (views, no copy)."""
        end = self.length + new_BT[0].shape[1]
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {end} were asked")
        for buffer, new in zip(self.buffers, new_BT, strict=True):
            buffer[:, self.length : end] = new
        self.length = end
        return tuple(buffer[:, :end] for buffer in self.buffers)


class DecodeCache:
    """Every layer's ``LayerCache`` (keyed as ``Transformer.layers``), and the rows' left padding.

    ``Transformer.forward(tokens, cache=...)`` reads ``positions`` and ``mask`` for its T new tokens,
    lets each layer append to its own cache, then calls ``advance``."""

    def __init__(self, layers: dict[str, LayerCache], pads_B: torch.Tensor, max_len: int):
        self.layers, self.pads_B, self.max_len = layers, pads_B, max_len
        self.length = 0

    def positions(self, T: int) -> torch.Tensor:
        """[B, T] RoPE positions of the next T slots: counted from each row's first real token."""
        slots = torch.arange(self.length, self.length + T, device=self.pads_B.device)
        return (slots[None, :] - self.pads_B[:, None]).clamp(min=0)

    def mask(self, T: int) -> torch.Tensor:
        """[B, 1, T, length + T] boolean, True where a new slot's query may attend a key: causal, and
        never a pad slot but its own."""
        S = self.length + T
        query = torch.arange(self.length, S, device=self.pads_B.device)[:, None]
        key = torch.arange(S, device=self.pads_B.device)[None, :]
        real = key[None] >= self.pads_B[:, None, None]
        return ((key <= query)[None] & (real | (key == query)[None])).unsqueeze(1)

    def advance(self, T: int) -> None:
        self.length += T

    def bytes_per_token(self) -> int:
        """Bytes the whole model keeps per position of one row."""
        return sum(layer.bytes_per_token() for layer in self.layers.values())
