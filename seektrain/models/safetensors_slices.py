"""Read a box (a range per dimension) of a tensor in a safetensors file with ``os.pread``, nothing else.

Why not ``safetensors.safe_open``: it memory-maps the file, and every page a slice touches stays in the
process's resident set until the file is closed. A column slice of a row-major weight touches every page
of it, so a rank that owns an eighth of a 5 GB shard ends up holding all 5 GB resident. Reading the
box's contiguous runs with ``pread`` into a buffer of the box's own size keeps resident memory at what
the rank keeps, and ``pread`` releases the GIL, so several threads read at once.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
tensors' bytes, row-major, offsets relative to the end of the header. Every way a header can disagree
with the file (truncated, unknown dtype, offsets past the end) is an ``HFWeightsError`` of one line.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from seektrain.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit


class HFWeightsError(UserError):
    """The weights of a model folder do not match its config.json; one line naming file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: ``start`` is the absolute file offset of its first element."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Every tensor of the file at ``path``, from its header (the tensors' bytes are not read)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {length} is past the end of the file ({size} bytes)")
            header = json.loads(fh.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        data_start = 8 + length
        out = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            out[name] = _tensor_info(name, spec, data_start, size)
        return out
    except OSError as err:
        raise HFWeightsError(f"{path}: cannot be read ({err.strerror or err})") from None
    except (ValueError, KeyError, TypeError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise HFWeightsError(
            f"{path}: not a readable safetensors file ({str(err)[:200]}); re-download or re-export it"
        ) from None


def _tensor_info(name: str, spec: dict, data_start: int, size: int) -> TensorInfo:
    dtype = DTYPES.get(spec["dtype"])
    if dtype is None:
        raise ValueError(f"tensor {name} has dtype {spec['dtype']!r}, which seektrain does not read")
    shape = tuple(int(d) for d in spec["shape"])
    begin, end = (int(x) for x in spec["data_offsets"])
    want = math.prod(shape) * dtype.itemsize
    if end - begin != want:
        raise ValueError(f"tensor {name}: {end - begin} bytes for shape {shape} of {spec['dtype']} ({want})")
    if data_start + end > size:
        raise ValueError(
            f"tensor {name} ends at byte {data_start + end}, past the end of the file ({size} bytes): "
            "the file is truncated"
        )
    return TensorInfo(dtype, shape, data_start + begin, want)


def box_runs(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> tuple[list[int], int]:
    """The element offsets of the contiguous runs a box covers in a row-major tensor, and the run length
    (in elements). The runs, in order, are the box's elements in row-major order."""
    if not shape:
        return [0], 1
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    partial = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[d])]
    if not partial:
        return [0], math.prod(shape)
    j = partial[-1]
    run = (box[j][1] - box[j][0]) * strides[j]
    starts = [box[j][0] * strides[j]]
    for d in range(j - 1, -1, -1):  # every index combination of the dimensions before j
        lo, hi = box[d]
        starts = [i * strides[d] + s for i in range(lo, hi) for s in starts]
    return starts, run


def read_box(fd: int, info: TensorInfo, box: tuple[tuple[int, int], ...], path: str) -> torch.Tensor:
    """The ``box`` of the tensor ``info`` describes, read from the open file ``fd`` (a new tensor of the
    file's dtype with the box's shape)."""
    itemsize = info.dtype.itemsize
    starts, run = box_runs(info.shape, box)
    shape = tuple(hi - lo for lo, hi in box)
    out = torch.empty(len(starts) * run * itemsize, dtype=torch.uint8)  # not zero-filled, unlike bytearray
    view = out.numpy().data
    pos = 0
    for start in starts:
        want = run * itemsize
        offset = info.start + start * itemsize
        while want:
            got = os.preadv(fd, [view[pos : pos + want]], offset)
            if got == 0:
                raise HFWeightsError(f"{path}: ends before the bytes its header lists (truncated)")
            pos, offset, want = pos + got, offset + got, want - got
    return out.view(info.dtype).view(shape)
