"""Write a safetensors file whose tensors arrive one piece at a time: the header (every tensor's name,
dtype, shape and byte range) is known before any data, so the file is written front to back and no
tensor, let alone the file, is ever whole in memory. The layout is the format's own (an 8-byte header
length, the JSON header padded with spaces to a multiple of 8, the data); ``safetensors`` reads it."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable

import torch

from seektrain.models.safetensors_slices import DTYPES

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_streamed(
    path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], pieces: Iterable[torch.Tensor]
) -> None:
    """``specs``: (name, dtype, shape) in file order; ``pieces``: their data in that order, each tensor
    as one or more consecutive row blocks of its dtype. Raises if the pieces do not add up."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    written = 0
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for piece in pieces:
            data = piece.detach().contiguous().view(torch.uint8).numpy()
            fh.write(data.data)
            written += data.nbytes
    if written != offset:
        raise RuntimeError(f"{path}: {written} bytes of tensor data written, the header lists {offset}")
