"""Context parallelism's load balance, by an oracle independent of the ring (issue 35): for each cp rank,
the test counts the causal query-key pairs its queries attend to, from the global positions
``split_batch`` hands that rank (a query at position p sees the p + 1 keys at positions 0..p), and
asserts the ranks' counts agree within one block of work (c·c pairs, c = T / (2·cp) the chunk length).
Contiguous chunks (rank i holding the i-th T/cp slice) fail it: their counts grow by 4·c² a rank."""

from __future__ import annotations

import pytest
import torch

from seektrain.data.batch import Batch
from seektrain.parallel.context_parallel import split_batch
from seektrain.parallel.ring_attention import _blocks


def _rank_positions(T: int, cp: int, rank: int) -> list[int]:
    tokens = torch.arange(T).unsqueeze(0)
    local = split_batch(Batch(tokens=tokens, labels=tokens.clone()), cp, rank, mtp_depths=0)
    assert torch.equal(local.tokens, local.positions), "positions must be the tokens' global places"
    return local.positions[0].tolist()


def _causal_pairs(positions: list[int]) -> int:
    return sum(p + 1 for p in positions)  # keys 0..p, counted from the whole sequence


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_cp_ranks_attend_to_equal_numbers_of_causal_pairs(cp, chunk):
    T = 2 * cp * chunk
    positions = {rank: _rank_positions(T, cp, rank) for rank in range(cp)}
    every = sorted(p for rank_positions in positions.values() for p in rank_positions)
    assert every == list(range(T)), f"cp={cp} T={T}: the ranks' positions are not a partition: {positions}"
    counts = {rank: _causal_pairs(p) for rank, p in positions.items()}
    assert sum(counts.values()) == T * (T + 1) // 2
    block = chunk * chunk
    spread = max(counts.values()) - min(counts.values())
    assert spread <= block, (
        f"cp={cp} T={T}: causal query-key pairs per rank {counts} differ by {spread}, "
        f"more than one block ({block} pairs)"
    )
    # The ring schedules the same work: the blocks rank r computes (fully visible c·c, diagonal c(c+1)/2)
    # add up to the pairs its positions see.
    for rank in range(cp):
        ring = sum(
            chunk * (chunk + 1) // 2 if diagonal else block
            for src in range(cp)
            for *_, diagonal in _blocks(rank, src, cp)
        )
        assert ring == counts[rank], (
            f"cp={cp} T={T} rank {rank}: ring blocks {ring} pairs, positions {counts[rank]}"
        )
