"""Hugging Face folders for the loader's tests, and the oracle they are checked against.

``write_release`` writes a model the way the releases are laid out: many shards with an index, and
optionally FP8 (e4m3) projections with one ``weight_scale_inv`` per ``block`` x ``block`` (pick a block
that does not divide the model's widths, so that shards cut scale blocks). ``full_weights`` is the
oracle: every stored tensor read whole through ``safetensors.safe_open``, FP8 dequantised whole, and
put into our tensor names: independent of the sliced reader under test.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seektrain.models import build_model
from seektrain.models.deepseek.hf_io import save_pretrained
from seektrain.models.deepseek.hf_weights import fp8_quantization_config, hf_layout, part_view, quantize_fp8


def write_release(model, out, dtype=torch.bfloat16, fp8_block: int | None = None, shards: int = 3) -> str:
    """``model`` as a release folder at ``out`` (``shards`` files of about equal size); returns its path."""
    staging = f"{out}.plain"
    save_pretrained(model, staging, dtype=dtype)
    with safe_open(os.path.join(staging, "model.safetensors"), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    if fp8_block:
        for key in [k for k in tensors if k.startswith("model.layers.") and k.endswith("proj.weight")]:
            tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(tensors[key], (fp8_block, fp8_block))
    os.makedirs(out, exist_ok=True)
    keys = sorted(tensors)
    names = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i * len(keys) // shards : (i + 1) * len(keys) // shards]
        save_file(
            {k: tensors[k].contiguous() for k in part}, os.path.join(out, name), metadata={"format": "pt"}
        )
        names.update(dict.fromkeys(part, name))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": names}, fh)
    config = json.load(open(os.path.join(staging, "config.json")))
    if fp8_block:
        config["quantization_config"] = fp8_quantization_config((fp8_block, fp8_block))
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh)
    for name in os.listdir(staging):
        os.remove(os.path.join(staging, name))
    os.rmdir(staging)
    return str(out)


def full_weights(folder: str, cfg, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of our model ``cfg`` in ``dtype``, read whole from ``folder`` (the oracle)."""
    config = json.load(open(os.path.join(folder, "config.json")))
    block = (config.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    names = json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"]
    model = build_model(cfg, device="meta", init=False)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    ours = {n: torch.empty(s, dtype=dtype) for n, s in shapes.items()}

    def stored(key):
        with safe_open(os.path.join(folder, names[key]), "pt") as fh:
            return fh.get_tensor(key)

    for entry in hf_layout(cfg, shapes):
        if entry.copy:
            continue
        value = stored(entry.hf_key)
        if value.dtype == torch.float8_e4m3fn:
            scale = stored(entry.hf_key + "_scale_inv")
            rows, cols = value.shape
            full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            value = value.float() * full
        part_view(ours[entry.ours], entry.part).copy_(value.to(dtype))
    if cfg.tie_word_embeddings:
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    return ours
