"""DistributedBatchLoader: no overlap, no skew, determinism, exact resume and resharding."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from seektrain.data import TokenDataset
from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.manifest import Manifest, Split, TokenizerInfo, write_manifest
from seektrain.data.prepare import ShardWriter

SEQ = 8


@pytest.fixture()
def arange_dir(tmp_path: Path) -> Path:
    """Token i == i, over 3 shards, so a window is identified by its first token (window = first // SEQ)."""
    n = 403  # 50 windows of 9 tokens (stride 8); shard edges at 150 and 300 cut through windows
    writer = ShardWriter(tmp_path, "shard", np.dtype("<u2"), 150)
    writer.write(np.arange(n))
    val = ShardWriter(tmp_path, "val", np.dtype("<u2"), 150)
    val.write(np.arange(40))
    info = TokenizerInfo("test", 65536, 0, None, "x")
    write_manifest(
        tmp_path, Manifest(info, "uint16", Split(writer.close(), n, 1), Split(val.close(), 40, 1), 0.1)
    )
    return tmp_path


def windows(batch) -> list[int]:
    tokens, labels = batch.tokens, batch.labels
    assert batch.positions is None and batch.document_ids is None  # plain windows of one stream
    assert tokens.dtype == labels.dtype == torch.long and tokens.shape == labels.shape
    assert torch.equal(labels, tokens + 1)  # labels are the inputs shifted by one (arange data)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert all(int(t[0]) % SEQ == 0 for t in tokens)
    return [int(t[0]) // SEQ for t in tokens]


def rank_loaders(directory: Path, dp: int, mb: int, seed: int = 0) -> list[DistributedBatchLoader]:
    ds = TokenDataset(directory)
    return [DistributedBatchLoader(ds, SEQ, mb, r, dp, seed) for r in range(dp)]


def test_dataset_reads_across_shards(arange_dir: Path) -> None:
    ds = TokenDataset(arange_dir)
    assert len(ds) == 403 and all(isinstance(m, np.memmap) for m in ds._tokens._maps)
    assert ds.read(145, 160).tolist() == list(range(145, 305))
    assert TokenDataset(arange_dir, "val").read(0, 40).tolist() == list(range(40))


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_no_overlap_no_skew(arange_dir: Path, dp: int) -> None:
    mb = 3
    [single] = rank_loaders(arange_dir, 1, mb)
    global_order = [w for b in itertools.islice(single, single.steps_per_epoch) for w in windows(b)]
    assert len(set(global_order)) == 48 and set(global_order) <= set(
        range(50)
    )  # 50 windows, 2 dropped for mb=3
    loaders = rank_loaders(arange_dir, dp, mb)
    steps = loaders[0].steps_per_epoch
    assert steps == 50 // (mb * dp)
    per_rank = [[w for b in itertools.islice(ld, steps) for w in windows(b)] for ld in loaders]
    assert len({len(p) for p in per_rank}) == 1  # every rank the same count
    union = [w for p in per_rank for w in p]
    assert len(union) == len(set(union))  # ranks never overlap
    n = steps * mb * dp
    assert set(union) == set(global_order[:n])  # same global order, whatever dp
    for r, mine in enumerate(per_rank):  # dealt round-robin: rank r gets global positions r, r+dp, ...
        assert mine == global_order[r:n:dp]


def test_epochs_roll_over_and_reshuffle(arange_dir: Path) -> None:
    [ld] = rank_loaders(arange_dir, 1, 5)
    e0 = [w for b in itertools.islice(ld, 10) for w in windows(b)]
    e1 = [w for b in itertools.islice(ld, 10) for w in windows(b)]
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1 and ld.epoch == 1


def test_determinism_per_seed(arange_dir: Path) -> None:
    def run(seed: int) -> list[int]:
        [ld] = rank_loaders(arange_dir, 1, 4, seed)
        return [w for b in itertools.islice(ld, 20) for w in windows(b)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_resume_continues_with_next_batch(arange_dir: Path) -> None:
    loaders = rank_loaders(arange_dir, 2, 2, seed=3)
    for _ in range(9):  # crosses the epoch boundary (12 steps per epoch) on resume
        for ld in loaders:
            next(ld)
    states = [ld.state_dict() for ld in loaders]
    expected = [[windows(next(ld)) for _ in range(8)] for ld in loaders]
    resumed = rank_loaders(arange_dir, 2, 2, seed=3)
    for ld, st in zip(resumed, states):
        ld.load_state_dict(st)
    assert [[windows(next(ld)) for _ in range(8)] for ld in resumed] == expected
    assert resumed[0].tokens_consumed() == loaders[0].tokens_consumed() == 17 * 2 * SEQ


def test_reshard_two_ranks_to_one(arange_dir: Path) -> None:
    two = rank_loaders(arange_dir, 2, 2, seed=1)
    for _ in range(5):
        for ld in two:
            next(ld)
    state = two[0].state_dict()
    [one] = rank_loaders(arange_dir, 1, 4, seed=1)
    one.load_state_dict(state)
    for _ in range(3):
        r0, r1 = windows(next(two[0])), windows(next(two[1]))
        assert windows(next(one)) == [r0[0], r1[0], r0[1], r1[1]]  # the same global batch, same order
    assert one.tokens_consumed() == 8 * 4 * SEQ


def test_loader_errors(arange_dir: Path) -> None:
    ds = TokenDataset(arange_dir)
    with pytest.raises(ValueError, match="fewer than one global batch") as err:
        DistributedBatchLoader(ds, 1000, 1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DistributedBatchLoader(ds, SEQ, 13, 0, 4)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):
        DistributedBatchLoader(ds, SEQ, 1, 2, 2)
    state = DistributedBatchLoader(ds, SEQ, 1).state_dict()
    with pytest.raises(ValueError, match="seq_len=8 but this run has 4"):
        DistributedBatchLoader(ds, 4, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="split='test': unknown split"):
        TokenDataset(arange_dir, "test")
    (arange_dir / "empty").mkdir()
    with pytest.raises(ValueError, match="no manifest.json found; run `seektrain data prepare"):
        TokenDataset(arange_dir / "empty")
    with pytest.raises(ValueError, match="no such directory"):
        TokenDataset(arange_dir / "nope")
