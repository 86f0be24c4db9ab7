"""Read boxes (a ``[start, stop)`` range per dimension) of tensors from a DCP checkpoint in this one
process, without reading the rest of those tensors: the streaming export's source.

DCP's own planner reads whole tensors into a plain state dict; ``BoxPlanner`` (DCP's documented
extension point, a ``LoadPlanner``) asks for just the boxes instead, so DCP reads only the saved chunks
that overlap them (each saved chunk is one training rank's shard of one tensor, read whole and narrowed).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from seektrain.checkpoint.manager import describe_error
from seektrain.errors import UserError
from seektrain.models.hf_slice_reader import Box


class BoxPlanner(DefaultLoadPlanner):
    """Loads ``boxes[fqn] = (box, buffer)``: the buffer (the box's shape) receives that box of ``fqn``
    (one box per tensor: DCP names a read's destination by the tensor and the box's start)."""

    def __init__(self, boxes: dict[str, tuple[Box, torch.Tensor]]):
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        requests = []
        assert self.metadata is not None  # set_up_planner has run: DCP calls it before this
        for fqn, (box, buffer) in self.boxes.items():
            meta = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(meta, TensorStorageMetadata):
                raise KeyError(f"{fqn} is not a tensor of the checkpoint")
            chunk = ChunkStorageMetadata(torch.Size([lo for lo, _ in box]), buffer.size())
            requests += create_read_items_for_chunk_list(fqn, meta, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.boxes[index.fqn][1]

    def commit_tensor(self, read_item, tensor) -> None:  # the buffer was written in place
        pass


def read_boxes(
    ckpt: str | Path, wanted: list[tuple[str, Box]], dtypes: dict[str, torch.dtype]
) -> list[torch.Tensor]:
    """The boxes ``wanted`` ((fqn, box) pairs) of checkpoint folder ``ckpt``, in order, each in its
    saved dtype (``dtypes``, from ``tensor_specs``). The boxes of one tensor are read as their bounding
    box, once: DCP reads a whole saved chunk for every box that overlaps it, so many small boxes of one
    chunk (an export's per-expert pieces) would read that chunk many times."""
    bounds: dict[str, list[list[int]]] = {}
    for fqn, box in wanted:
        if fqn not in bounds:
            bounds[fqn] = [[lo, hi] for lo, hi in box]
        else:
            for d, (lo, hi) in enumerate(box):
                bounds[fqn][d] = [min(bounds[fqn][d][0], lo), max(bounds[fqn][d][1], hi)]
    buffers = {
        fqn: (
            tuple((lo, hi) for lo, hi in bound),
            torch.empty(tuple(hi - lo for lo, hi in bound), dtype=dtypes[fqn]),
        )
        for fqn, bound in bounds.items()
    }
    load_here({}, ckpt, "cannot be read", "pick another checkpoint", planner=BoxPlanner(buffers))
    out = []
    for fqn, box in wanted:
        bound, buffer = buffers[fqn]
        out.append(buffer[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(box, bound))])
    return out


def load_here(state: dict, ckpt: str | Path, problem: str, fix: str, planner=None) -> None:
    """``dcp.load`` of ``state`` from checkpoint folder ``ckpt`` in this one process (no process group);
    any failure is one ``UserError`` line: ``checkpoint {ckpt} {problem} ({DCP's reason}); {fix}``."""
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=FileSystemReader(str(ckpt)), planner=planner, no_dist=True)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise UserError(f"checkpoint {ckpt} {problem} ({describe_error(err)}); {fix}") from None


def tensor_specs(ckpt: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor's full shape and saved dtype in the checkpoint, from its metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {
        k: (tuple(v.size), v.properties.dtype)
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata)
    }
