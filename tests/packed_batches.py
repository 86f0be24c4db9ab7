"""Hand-built packed batches for the packing tests: documents of uneven lengths with uneven loss masks,
packed into rows the way ``data/batch.py`` describes (positions restart at each document, the last
token of a document and padding are never trained, padding is a document of its own)."""

from __future__ import annotations

import torch

from seektrain.data.batch import Batch
from seektrain.models.linear_cross_entropy import IGNORE


def document(
    length: int, vocab: int, gen: torch.Generator, trained: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, mask) of one document; ``trained``: the share of its tokens with a loss, at its end
    (as an assistant turn after a prompt)."""
    tokens = torch.randint(1, vocab, (length,), generator=gen)
    mask = torch.zeros(length, dtype=torch.bool)
    mask[length - max(1, round(trained * length)) :] = True
    return tokens, mask


def doc_labels(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token labels of one document: trained where the next token is, never at its last token."""
    labels = torch.full_like(tokens, IGNORE)
    labels[:-1] = torch.where(mask[1:], tokens[1:], IGNORE)
    return labels


def pack(docs: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int) -> Batch:
    """One row [1, seq_len] holding ``docs`` and padding at the end."""
    tokens, labels, positions, ids = [], [], [], []
    for i, (t, m) in enumerate(docs):
        tokens.append(t)
        labels.append(doc_labels(t, m))
        positions.append(torch.arange(len(t)))
        ids.append(torch.full((len(t),), i))
    pad = seq_len - sum(len(t) for t in tokens)
    assert pad >= 0
    if pad:
        tokens.append(torch.zeros(pad, dtype=torch.int64))
        labels.append(torch.full((pad,), IGNORE))
        positions.append(torch.arange(pad))
        ids.append(torch.full((pad,), len(docs)))
    return Batch(*(torch.cat(parts)[None] for parts in (tokens, labels, positions, ids)))


def uneven_rows(vocab: int, seq_len: int, seed: int) -> list[Batch]:
    """Four packed rows with very different trained-token counts: about all, two tokens, several
    documents half trained, one short document and much padding."""
    gen = torch.Generator().manual_seed(seed)
    third = seq_len // 3
    return [
        pack([document(seq_len, vocab, gen, 1.0)], seq_len),
        pack([document(seq_len - 4, vocab, gen, 3 / (seq_len - 4))], seq_len),
        pack(
            [
                document(third, vocab, gen, 0.5),
                document(third, vocab, gen, 0.3),
                document(seq_len - 2 * third - 3, vocab, gen, 0.8),
            ],
            seq_len,
        ),
        pack([document(third, vocab, gen, 0.6)], seq_len),
    ]


def cat_rows(rows: list[Batch]) -> Batch:
    return Batch(
        *(
            torch.cat([getattr(r, name) for r in rows])
            for name in ("tokens", "labels", "positions", "document_ids")
        )
    )
