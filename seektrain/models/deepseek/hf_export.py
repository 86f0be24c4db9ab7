"""Write the release layout of a DeepSeek-family model piece by piece, from wherever its tensors are:
an in-memory model (``save_pretrained``), a DCP training checkpoint, or a LoRA checkpoint's adapters
merged into its Hugging Face base (``checkpoint/hf_export_sources.py``).

The source is a ``BoxReader``: given (our tensor name, box) requests it returns those boxes. Every stored
tensor is cut into row pieces of at most ``PIECE_BYTES`` (fp32-sized), consecutive pieces are asked for
in groups of about ``GROUP_BYTES``, and each safetensors file is written front to back
(``models/safetensors_writer.py``), so host memory while exporting is one group plus what the
source needs to produce it, whatever the model's size. The files, the index and config.json are
those of the release (``hf_weights.hf_layout``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator

import torch

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.hf_config import config_to_hf
from seektrain.models.deepseek.hf_folder import INDEX_FILE, SINGLE_FILE
from seektrain.models.deepseek.hf_weights import (
    FP8_DTYPES,
    Entry,
    dtype_name,
    hf_layout,
    part_region,
    part_shape,
    shard_plan,
)
from seektrain.models.hf_slice_reader import Box, row_ranges
from seektrain.models.safetensors_writer import write_streamed

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # what the official releases and transformers use
PIECE_BYTES = 64 * 2**20
GROUP_BYTES = 256 * 2**20
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")

BoxReader = Callable[[list[tuple[str, Box]]], list[torch.Tensor]]


def export_release(
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    read: BoxReader,
    path: str | os.PathLike,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``path`` (weights, index when sharded, config.json) for a model of ``cfg`` whose full
    tensor shapes are ``shapes``, reading its tensors through ``read``; returns the weight files. The MoE
    balancing bias stays fp32. Weight files of an earlier export in ``path`` are removed first, so a
    stale shard can never be mixed in."""
    if dtype in FP8_DTYPES:
        raise UserError("saving FP8 weights is not supported; choose bf16, fp16 or fp32")
    path = os.fspath(path)

    def cast(entry: Entry) -> torch.dtype:
        return torch.float32 if entry.ours.endswith("e_score_correction_bias") else dtype

    entries = hf_layout(cfg, shapes)
    stored = [part_shape(shapes[e.ours], e.part) for e in entries]
    sizes = [math.prod(shape) * cast(e).itemsize for e, shape in zip(entries, stored)]
    ranges = shard_plan(sizes, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(ranges) == 1
        else [f"model-{i + 1:05d}-of-{len(ranges):05d}.safetensors" for i in range(len(ranges))]
    )
    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):
        if _SHARD_NAME.match(old) or old == INDEX_FILE:
            os.remove(os.path.join(path, old))
    weight_map = {}
    for name, (start, end) in zip(names, ranges):
        chosen = list(range(start, end))
        specs = [(entries[i].hf_key, cast(entries[i]), stored[i]) for i in chosen]
        pieces = _pieces([(entries[i], stored[i], cast(entries[i])) for i in chosen], shapes, read)
        write_streamed(os.path.join(path, name), specs, pieces)
        weight_map.update({entries[i].hf_key: name for i in chosen})
    if len(names) > 1:
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config_to_hf(cfg, dtype_name(dtype)), fh, indent=2)
        fh.write("\n")
    return names


def _pieces(
    items: list[tuple[Entry, tuple[int, ...], torch.dtype]], shapes: dict, read: BoxReader
) -> Iterator:
    """The data of ``items`` (entry, stored shape, dtype) in order, in row pieces read a group at a time."""
    group: list[tuple[str, Box, tuple[int, ...], torch.dtype]] = []
    group_bytes = 0
    for entry, shape, dtype in items:
        region, stored_dims = part_region(shapes[entry.ours], entry.part)
        row_elems = math.prod(shape[1:]) if shape else 1
        for lo, hi in row_ranges(shape[0] if shape else 1, row_elems, PIECE_BYTES):
            box = list(region)
            if shape:
                first = region[stored_dims[0]][0]
                box[stored_dims[0]] = (first + lo, first + hi)
            group.append((entry.ours, tuple(box), (hi - lo, *shape[1:]) if shape else (), dtype))
            group_bytes += 4 * (hi - lo) * row_elems
            if group_bytes >= GROUP_BYTES:
                yield from _read_group(group, read)
                group, group_bytes = [], 0
    yield from _read_group(group, read)


def _read_group(group, read: BoxReader) -> Iterator[torch.Tensor]:
    if not group:
        return
    values = read([(ours, box) for ours, box, _, _ in group])
    for (_, _, shape, dtype), value in zip(group, values):
        yield value.reshape(shape).to(dtype)
