"""The tensor layout of a Hugging Face DeepSeek checkpoint and how it maps onto our parameters.

One table (``hf_layout``) lists every tensor of the *release* layout for a model: its name, which of our
tensors it comes from and which part of it. Saving walks the table; loading looks names up in it. The
release layout differs from ours in three ways:

* a ``model.`` prefix on everything but ``lm_head``;
* routed experts stored one tensor per expert and projection
  (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``) where we keep two fused
  tensors per layer; transformers 5 keeps them fused in memory (``mlp.experts.gate_up_proj`` /
  ``down_proj``, same shapes as ours) but writes the per-expert form, and we accept both on load;
* the DeepSeek-V3 MTP module stored as an extra decoder layer ``model.layers.{N+k}`` with its own
  ``enorm``/``hnorm``/``eh_proj``, ``shared_head.norm`` (our ``mtp.{k}.norm``) and copies of the
  embedding and output head (``embed_tokens``, ``shared_head.head``) that we write but never read.

The official V3 weights are FP8 (e4m3) with one fp32 ``weight_scale_inv`` per 128x128 block, expanded
slice by slice on load (``models/hf_slice_reader.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from seektrain.models.config import ModelConfig

FP8_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
}
_MTP_COPIES = {"embed_tokens.weight": "embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# Keys some older checkpoints carry that describe no weight (recomputed RoPE tables).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Entry:
    """One tensor of the release layout.

    ``part`` selects a slice of our tensor: ``None`` is all of it, ``("gate"|"up"|"down", e)`` one expert
    of a fused expert tensor. ``copy`` marks tensors written for other loaders and skipped on load.
    """

    hf_key: str
    ours: str
    part: tuple[str, int] | None = None
    copy: bool = False


def _layer_entries(hf_prefix: str, our_prefix: str, names: list[str], shapes: dict) -> list[Entry]:
    out = []
    for rest in names:
        ours = our_prefix + rest
        if rest.endswith("mlp.experts.gate_up_proj"):
            base = hf_prefix + rest[: -len("gate_up_proj")]
            for e in range(shapes[ours][0]):
                out.append(Entry(f"{base}{e}.gate_proj.weight", ours, ("gate", e)))
                out.append(Entry(f"{base}{e}.up_proj.weight", ours, ("up", e)))
        elif rest.endswith("mlp.experts.down_proj"):
            base = hf_prefix + rest[: -len("down_proj")]
            out.extend(
                Entry(f"{base}{e}.down_proj.weight", ours, ("down", e)) for e in range(shapes[ours][0])
            )
        else:
            out.append(Entry(hf_prefix + rest, ours))
    return out


def hf_layout(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> list[Entry]:
    """Every tensor of the release layout, in file order, for a model whose state-dict shapes are ``shapes``."""
    by_layer: dict[str, list[str]] = {}
    mtp_own: dict[int, list[str]] = {}
    for name in shapes:
        m = re.match(r"^(layers\.\d+|mtp\.\d+\.block)\.(.*)$", name)
        if m:
            by_layer.setdefault(m.group(1), []).append(m.group(2))
        elif name.startswith("mtp."):
            depth, rest = name.split(".", 2)[1:]
            mtp_own.setdefault(int(depth), []).append(rest)
    entries = [Entry("model.embed_tokens.weight", "embed_tokens.weight")]
    for i in range(cfg.num_hidden_layers):
        entries += _layer_entries(
            f"model.layers.{i}.", f"layers.{i}.", by_layer.get(f"layers.{i}", []), shapes
        )
    entries.append(Entry("model.norm.weight", "norm.weight"))
    if not cfg.tie_word_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.weight"))
    for k in range(cfg.num_nextn_predict_layers):
        hf = f"model.layers.{cfg.num_hidden_layers + k}."
        entries += _layer_entries(hf, f"mtp.{k}.block.", by_layer.get(f"mtp.{k}.block", []), shapes)
        inverse = {v: key for key, v in _MTP_OWN.items()}
        entries += [Entry(hf + inverse[rest], f"mtp.{k}.{rest}") for rest in mtp_own.get(k, [])]
        entries += [Entry(hf + key, ours, copy=True) for key, ours in _MTP_COPIES.items()]
    return entries


def fused_alternatives(entries: list[Entry]) -> dict[str, str]:
    """transformers-5 fused expert names (``...mlp.experts.gate_up_proj``) -> our tensor name."""
    out = {}
    for entry in entries:
        m = _EXPERT.match(entry.hf_key)
        if m and entry.part is not None and entry.part[1] == 0:
            kind = "gate_up_proj" if entry.part[0] in ("gate", "up") else "down_proj"
            out[f"{m.group(1)}.{kind}"] = entry.ours
    return out


def is_ignored(hf_key: str) -> bool:
    return bool(_IGNORED.search(hf_key))


def part_shape(full: tuple[int, ...], part: tuple[str, int] | None) -> tuple[int, ...]:
    """Shape of the release tensor that holds ``part`` of our tensor of shape ``full``."""
    if part is None:
        return tuple(full)
    if part[0] == "down":
        return tuple(full[1:])
    return (full[1] // 2, full[2])


def part_view(tensor: torch.Tensor, part: tuple[str, int] | None) -> torch.Tensor:
    """The slice of our tensor that a release tensor fills (a view: writes go through)."""
    if part is None:
        return tensor
    kind, e = part
    if kind == "down":
        return tensor[e]
    half = tensor.shape[1] // 2
    return tensor[e, :half] if kind == "gate" else tensor[e, half:]


def part_region(
    full: tuple[int, ...], part: tuple[str, int] | None
) -> tuple[tuple[tuple[int, int], ...], range]:
    """The box of our tensor (shape ``full``) that a stored tensor holding ``part`` of it fills, and
    which of our dimensions the stored tensor has."""
    whole = tuple((0, d) for d in full)
    if part is None:
        return whole, range(len(full))
    kind, e = part
    half = full[1] // 2
    rows = {"down": (0, full[1]), "gate": (0, half), "up": (half, full[1])}[kind]
    return ((e, e + 1), rows, *whole[2:]), range(1, len(full))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight in DeepSeek-V3's release form: e4m3 values and one fp32 ``weight_scale_inv`` per
    ``block`` (its absolute maximum over 448, e4m3's largest value); edge blocks may be partial. What
    the loader's dequantisation inverts, used to build FP8 folders (tests, benchmarks)."""
    rows, cols = weight.shape
    b0, b1 = block
    pad = torch.zeros(math.ceil(rows / b0) * b0, math.ceil(cols / b1) * b1)
    pad[:rows, :cols] = weight.float().abs()
    scale = pad.view(pad.shape[0] // b0, b0, -1, b1).amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return (weight.float() / full).to(torch.float8_e4m3fn), scale


def fp8_quantization_config(block: tuple[int, int] = (128, 128)) -> dict:
    """The ``quantization_config`` of config.json that goes with ``quantize_fp8``'s weights."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }


def shard_plan(sizes: list[int], max_shard_bytes: int) -> list[tuple[int, int]]:
    """Split consecutive tensors (byte ``sizes``) into [start, end) ranges of at most ``max_shard_bytes``
    (a single tensor larger than that gets a shard of its own)."""
    ranges, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        if acc and acc + size > max_shard_bytes:
            ranges.append((start, i))
            start, acc = i, 0
        acc += size
    if start < len(sizes) or not ranges:
        ranges.append((start, len(sizes)))
    return ranges


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
