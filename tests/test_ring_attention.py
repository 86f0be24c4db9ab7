"""The context-parallel ring attention (seektrain/parallel/ring_attention.py) equals plain causal attention
on the whole sequence, forward and backward, on 2 and 3 gloo ranks: MLA's unequal query/key and value
head dims, packed document masks (ids that change inside chunks and at chunk boundaries), and the
batch split of seektrain/parallel/context_parallel.py (rank i holds chunks i and 2·cp−1−i)."""

from __future__ import annotations

import os

import pytest
import torch

from seektrain.data.batch import Batch
from seektrain.models.kernels import causal_attention, document_causal_mask
from seektrain.parallel.context_parallel import chunk_index, split_batch
from spawn_ranks import spawn_ranks

B, H, T, K, V = 2, 3, 24, 12, 8  # MLA-like: query/key head dim differs from the value's


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g) for d in (K, K, V))
    docs = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10, [7] * 12 + [8] * 12])
    dout = torch.randn(B, H, T, V, generator=g)
    return q, k, v, docs, dout


def _reference(packed: bool):
    q, k, v, docs, dout = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v, 0.3, document_causal_mask(docs) if packed else None)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from seektrain.parallel.context_parallel import chunk_documents
    from seektrain.parallel.ring_attention import ring_attention

    cp, group = dist.get_world_size(), dist.group.WORLD
    idx = chunk_index(T, cp, rank)
    results = {}
    for packed in (False, True):
        q, k, v, docs, dout = _inputs()
        q, k, v = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        local_docs = chunk_documents(docs[:, idx], group=group) if packed else None
        out = ring_attention(q, k, v, 0.3, local_docs, group)
        out.backward(dout[:, :, idx])
        results[packed] = (out.detach(), q.grad, k.grad, v.grad)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_equals_plain_attention(tmp_path, cp):
    out_dir = tmp_path / f"cp-{cp}"
    out_dir.mkdir()
    spawn_ranks(_worker, cp, str(out_dir))
    for packed in (False, True):
        want = _reference(packed)
        for rank in range(cp):
            got = torch.load(out_dir / f"rank{rank}.pt")[packed]
            idx = chunk_index(T, cp, rank)
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                torch.testing.assert_close(g, w[:, :, idx], atol=1e-5, rtol=1e-5, msg=f"{name} rank {rank}")


def test_split_batch_chunks_and_shifts_before_splitting():
    """Rank i keeps chunks i and 2·cp−1−i; positions are global; MTP inputs and targets are shifted on
    the whole row (a shift inside the rank's chunks would read the wrong tokens at each chunk's end)."""
    tokens = torch.arange(16).view(1, 16)
    labels = tokens + 100
    docs = torch.tensor([[0] * 6 + [1] * 10])
    batch = Batch(tokens, labels, None, docs)
    assert chunk_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    local = split_batch(batch, 2, 0, mtp_depths=1)
    assert local.tokens.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert local.positions.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert local.document_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert local.mtp_tokens[..., 0].tolist() == [[1, 2, 3, 4, 13, 14, 15, 15]]
    # next-token labels, then depth 1's: the label one ahead, ignored across the document change (5→6)
    assert local.labels[..., 0].tolist() == [[100, 101, 102, 103, 112, 113, 114, 115]]
    assert local.labels[..., 1].tolist() == [[101, 102, 103, 104, 113, 114, 115, -100]]
    other = split_batch(batch, 2, 1, mtp_depths=1)
    assert other.labels[..., 1].tolist() == [[105, -100, 107, 108, 109, 110, 111, 112]]
