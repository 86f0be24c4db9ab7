"""Where a streamed Hugging Face export (``models/deepseek/hf_export.export_release``) reads its
tensors from, box by box, so that no process ever holds the whole model:

* ``checkpoint_boxes``: a full training checkpoint (DCP, any layout it was saved from): each box read
  from the saved chunks that overlap it (``dcp_boxes.py``).
* ``merged_lora_boxes``: a LoRA checkpoint, whose base is its Hugging Face folder (read slice by slice,
  ``models/hf_slice_reader.py``) and whose adapters are in the checkpoint: each box is ``W + alpha/r · B @ A``
  over just that box's rows and columns, with the base held as training held it (``base_dtype``:
  weights cast down, the balancing bias fp32) and the sum in fp32, as ``lora_export.merged_state_dict``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from seektrain.checkpoint.dcp_boxes import read_boxes, tensor_specs
from seektrain.models.hf_slice_reader import Box, LocalShard, fill_shards
from seektrain.models.lora import frozen_dtype
from seektrain.models.lora_export import adapter_pairs

MODEL = "model."  # the trainer's checkpoints hold the model's state dict under "model"


def checkpoint_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Our full tensor shapes, as the checkpoint holds them (optimizer state left out)."""
    return {k[len(MODEL) :]: shape for k, (shape, _) in tensor_specs(ckpt).items() if k.startswith(MODEL)}


def checkpoint_boxes(ckpt: Path):
    """A ``BoxReader`` over a full training checkpoint."""
    dtypes = {k: dtype for k, (_, dtype) in tensor_specs(ckpt).items()}

    def read(requests: list[tuple[str, Box]]) -> list[torch.Tensor]:
        return read_boxes(ckpt, [(MODEL + name, box) for name, box in requests], dtypes)

    return read


def merged_lora_boxes(
    ckpt: Path,
    base,
    shapes: dict[str, tuple[int, ...]],
    params: set[str],
    base_dtype: torch.dtype,
    scaling: float,
):
    """A ``BoxReader`` of the merged model: ``base`` is the base folder as the family opened it (a
    ``WeightSource``, e.g. ``models/deepseek/hf_folder.HFFolder``), ``shapes`` our full shapes,
    ``params`` the names that are parameters (held in ``base_dtype`` by training; buffers are not)."""
    specs = tensor_specs(ckpt)
    dtypes = {k: dtype for k, (_, dtype) in specs.items()}
    names = {k[len(MODEL) :]: k[len(MODEL) :] for k in specs if k.startswith(MODEL)}
    pairs = adapter_pairs(names)  # base weight -> (A name, B name)

    def held(name: str, value: torch.Tensor) -> torch.Tensor:
        """The base as training held it (``freeze_base``'s rule)."""
        return value.to(frozen_dtype(value.dtype, base_dtype)) if name in params else value

    def read(requests: list[tuple[str, Box]]) -> list[torch.Tensor]:
        shards = [
            LocalShard(name, torch.empty(tuple(hi - lo for lo, hi in box)), box, shapes[name])
            for name, box in requests
        ]
        fill_shards(shards, base)
        adapted = [(name, box) for name, box in requests if name in pairs]
        wanted = [item for name, box in adapted for item in _adapter_boxes(pairs[name], box, specs)]
        halves = iter(read_boxes(ckpt, wanted, dtypes)) if wanted else iter(())
        out = []
        for (name, _), shard in zip(requests, shards):
            value = held(name, shard.local)
            if name in pairs:
                a, b = next(halves).float(), next(halves).float()
                delta = torch.bmm(b, a) if a.dim() == 3 else b @ a
                value = (value.float() + scaling * delta).to(value.dtype)
            out.append(value)
        return out

    return read


def _adapter_boxes(names: tuple[str, str], box: Box, specs) -> list[tuple[str, Box]]:
    """(A, B) boxes whose ``B @ A`` is ``box`` of the adapted weight: A's columns and B's rows of the
    box (and its experts, for a fused expert weight: A ``[E, r, in]``, B ``[E, out, r]``)."""
    a_name, b_name = (MODEL + n for n in names)
    a_shape, b_shape = specs[a_name][0], specs[b_name][0]
    if len(box) == 2:
        (r0, r1), (c0, c1) = box
        return [(a_name, ((0, a_shape[0]), (c0, c1))), (b_name, ((r0, r1), (0, b_shape[1])))]
    (e0, e1), (r0, r1), (c0, c1) = box
    return [(a_name, ((e0, e1), (0, a_shape[1]), (c0, c1))), (b_name, ((e0, e1), (r0, r1), (0, b_shape[2])))]
