"""Context parallelism (``parallel.cp``): every sequence split over the ``cp`` ranks of a data-parallel
group, in load-balanced chunks; attention runs as a ring over them (``parallel/ring_attention.py``).

Two functions apply it, and the model knows nothing of it:

* ``apply_context_parallel(model, cp_mesh)`` swaps the attention kernel (and the document-mask
  builder) of the plain model's modules for the ring's: the modules route attention through their
  ``Kernels`` (``models/kernels.py``), so this is a constructor argument replaced, not a code path.
* ``local_batch(plan, meshes, batch)`` keeps this rank's chunks of a batch. The ``cp`` ranks of one
  data-parallel group read the same batch (the loader's data-parallel rank does not count cp). Of
  ``2·cp`` equal chunks, rank ``i`` keeps chunks ``i`` and ``2·cp−1−i``: under causal attention the
  early chunks see few keys and the late ones many, so each rank gets the same work. Whatever reads
  neighbouring tokens is decided on the whole sequence first, then split: the labels (already the next
  token), every MTP depth's targets and input tokens (shifted by their depth, and masked where they
  cross a document), the positions (RoPE sees each token's global position, not its place in the
  chunk) and the document ids (which attention compares across chunks).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from seektrain.data.batch import Batch
from seektrain.models.kernels import Kernels
from seektrain.models.linear_cross_entropy import shift_labels
from seektrain.parallel.mesh import Meshes
from seektrain.parallel.ring_attention import chunk_ids, ring_attention


def _ring_kernel(q, k, v, scale, mask, *, group: ProcessGroup):
    """``Kernels.attention`` under context parallelism; ``mask``: ``chunk_documents``' result or None."""
    return ring_attention(q, k, v, scale, mask, group)


def chunk_documents(document_ids_BT: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """``Kernels.document_mask`` under context parallelism: every rank's document ids of this batch,
    gathered once per forward, as [B, 2·cp, T/2] by global chunk index (the ring's blocks compare a
    query chunk's ids with a key chunk's)."""
    cp = group.size()
    B, T = document_ids_BT.shape
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(
        document_ids_BT.contiguous(), cp, group.group_name
    )
    parts = torch.ops._c10d_functional.wait_tensor(gathered).view(cp, B, 2, T // 2)
    docs = torch.empty(B, 2 * cp, T // 2, dtype=document_ids_BT.dtype, device=document_ids_BT.device)
    for rank in range(cp):
        for half, chunk in enumerate(chunk_ids(rank, cp)):
            docs[:, chunk] = parts[rank, :, half]
    return docs


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> int:
    """Give every module of ``model`` that holds ``Kernels`` the ring attention over ``cp_mesh`` (and its
    document ids in place of a mask); returns how many attention modules now run the ring."""
    group = cp_mesh.get_group()
    attention = functools.partial(_ring_kernel, group=group)
    document_mask = functools.partial(chunk_documents, group=group)
    swapped = 0
    for module in model.modules():
        kernels = getattr(module, "kernels", None)
        if isinstance(kernels, Kernels):
            swap = dataclasses.replace(kernels, attention=attention, document_mask=document_mask)
            module.kernels = swap  # type: ignore[assignment]  # nn.Module.__setattr__ is typed Tensor | Module
            swapped += hasattr(module, "o_proj")
    return swapped


def cp_degree(model: nn.Module) -> tuple[int, int]:
    """(cp size of the ring attention the model's attention modules run, how many run it): the layout
    record's ``cp`` and ``cp_attention_layers`` (1 and 0 for the plain kernel)."""
    sizes = []
    for module in model.modules():
        kernels = getattr(module, "kernels", None)
        if hasattr(module, "o_proj") and isinstance(kernels, Kernels):
            fn = kernels.attention
            if isinstance(fn, functools.partial) and fn.func is _ring_kernel:
                sizes.append(fn.keywords["group"].size())
    return (min(sizes) if sizes else 1), len(sizes)


def chunk_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The sequence positions rank ``rank`` of ``cp`` keeps: its two chunks, in order."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, cp)])


def _shift_tokens(tokens_BT: torch.Tensor, depth: int) -> torch.Tensor:
    """MTP depth ``depth``'s input tokens: ``depth`` ahead, the tail repeating the last token (its targets
    are past the end, ignored), as ``Transformer._mtp`` shifts a whole row."""
    return torch.cat([tokens_BT[:, depth:], tokens_BT[:, -1:].expand(-1, depth)], dim=1)


def split_batch(batch: Batch, cp: int, rank: int, mtp_depths: int) -> Batch:
    """Rank ``rank``'s chunks of ``batch`` (see the module docstring). With MTP the labels become each
    head's targets [B, T/cp, 1 + depths] and ``mtp_tokens`` each depth's inputs [B, T/cp, depths]."""
    B, T = batch.tokens.shape
    idx = chunk_index(T, cp, rank, batch.tokens.device)
    positions = batch.positions
    if positions is None:
        positions = torch.arange(T, device=batch.tokens.device).expand(B, T)
    labels, mtp_tokens = batch.labels, None
    if mtp_depths:
        depths = range(1, mtp_depths + 1)
        labels = torch.stack([labels, *(shift_labels(labels, d, batch.document_ids) for d in depths)], dim=-1)
        mtp_tokens = torch.stack([_shift_tokens(batch.tokens, d) for d in depths], dim=-1)
    return Batch(
        tokens=batch.tokens[:, idx],
        labels=labels[:, idx],
        positions=positions[:, idx],
        document_ids=None if batch.document_ids is None else batch.document_ids[:, idx],
        mtp_tokens=None if mtp_tokens is None else mtp_tokens[:, idx],
    )


def local_batch(plan, meshes: Meshes, batch: Batch) -> Batch:
    """What this rank trains of ``batch`` under ``plan`` (a ``RunPlan``): its context-parallel chunks
    (its place on ``meshes.cp``, ``parallel.mesh.Meshes``), or the batch itself without context
    parallelism."""
    if plan.cp == 1:
        return batch
    depths = plan.model.num_nextn_predict_layers if plan.use_mtp else 0
    return split_batch(batch, plan.cp, meshes.cp_rank, depths)
