"""The loader's document layouts: packed rows, one chat document per row, and document-masked windows.

Labels, positions and document ids are checked against each document taken alone; resume and the
dealing to ranks are exact as for plain windows; plain windows of a text corpus stay as they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from seektrain.data import TokenDataset, prepare_dataset
from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.packing import row_fields, rows_of
from seektrain.data.prepare import RowOptions
from seektrain.models.linear_cross_entropy import IGNORE

SEQ = 64


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(["fox", "dog", "lazy", "quick", "brown", "jumps"], size=n))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """40 conversations of 1-2 turns and varied lengths (byte tokenizer, DeepSeek-LLM's template)."""
    root = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        turns = []
        for _ in range(int(rng.integers(1, 3))):
            turns += [
                {"role": "user", "content": _words(rng, int(rng.integers(1, 3)))},
                {"role": "assistant", "content": _words(rng, int(rng.integers(1, 3)))},
            ]
        rows.append({"messages": turns})
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_dataset(
        [root / "c.jsonl"],
        root / "data",
        "byte",
        val_fraction=0.0,
        shard_tokens=300,
        rows=RowOptions("deepseek-llm", max_len=SEQ),
    )
    return root / "data"


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """60 text documents of 1-200 bytes, some longer than SEQ."""
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(1)
    docs = [_words(rng, int(rng.integers(1, 35)))[: int(rng.integers(1, 200))] for _ in range(60)]
    (root / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_dataset([root / "t.jsonl"], root / "data", "byte", val_fraction=0.0, shard_tokens=500)
    return root / "data"


def _documents(ds: TokenDataset) -> list[tuple[np.ndarray, np.ndarray]]:
    ends = ds.document_ends()
    starts = np.concatenate([[0], ends[:-1]])
    return [
        (ds.read(int(a), int(b - a)).astype(np.int64), ds.read_mask(int(a), int(b - a)))
        for a, b in zip(starts, ends)
    ]


def _alone(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Labels of a document run alone: the next token where it is trained, IGNORE at the end."""
    labels = np.where(mask[1:] != 0, tokens[1:], IGNORE)
    return np.append(labels, IGNORE)


def _segments(batch, pad: int) -> tuple[list, int]:
    """Every (tokens, labels, positions) run of one document id in the rows of a batch, and how many
    rows end in padding (the last id of a row: pad tokens, nothing trained)."""
    out, padded = [], 0
    for row in range(batch.tokens.shape[0]):
        ids = batch.document_ids[row].numpy()
        for doc in np.unique(ids):
            sel = ids == doc
            seg = (
                batch.tokens[row].numpy()[sel],
                batch.labels[row].numpy()[sel],
                batch.positions[row].numpy()[sel],
            )
            if doc == ids[-1] and set(seg[0]) == {pad} and set(seg[1]) == {IGNORE}:
                padded += 1
            else:
                out.append(seg)
    return out, padded


def test_rows_of_is_greedy_next_fit():
    ends = np.array([3, 8, 10, 20, 22])
    assert rows_of(ends, 6, "packed", False, "d").tolist() == [[0, 3], [3, 8], [8, 10], [10, 16], [16, 22]]
    assert rows_of(np.array([2, 4, 6, 7]), 6, "packed", False, "d").tolist() == [[0, 6], [6, 7]]
    with pytest.raises(
        ValueError,
        match="d: document 3 has 10 tokens, more than train.seq_len=6; re-prepare with --max-len 6",
    ):
        rows_of(ends, 6, "packed", True, "d")
    with pytest.raises(ValueError, match="document 3 has 10 tokens"):
        rows_of(ends, 6, "documents", True, "d")


def test_row_fields_by_hand():
    tokens, mask = np.array([11, 12, 13, 14, 15]), np.array([0, 0, 1, 0, 1])
    t, labels, positions, ids = row_fields(tokens, mask, np.array([3]), 7, pad_id=9)
    assert t.tolist() == [11, 12, 13, 14, 15, 9, 9]
    assert labels.tolist() == [IGNORE, 13, IGNORE, 15, IGNORE, IGNORE, IGNORE]
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 1] and ids.tolist() == [0, 0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("which", ["chat", "text"])
def test_packed_rows_hold_each_document_once_as_if_alone(which, chat_dir, text_dir):
    ds = TokenDataset(chat_dir if which == "chat" else text_dir)
    loader = DistributedBatchLoader(ds, SEQ, 1, packing=True, seed=3)
    pad = ds.manifest.tokenizer.eos_id
    segments, padded = [], 0
    for _ in range(loader.steps_per_epoch):
        batch = next(loader)
        assert batch.packed and batch.tokens.shape == (1, SEQ)
        more, rows_padded = _segments(batch, pad)
        segments, padded = segments + more, padded + rows_padded
    pieces = []  # documents as stored, text ones longer than SEQ cut into SEQ pieces
    for tokens, mask in _documents(ds):
        for a in range(0, tokens.size, SEQ):
            pieces.append((tokens[a : a + SEQ], mask[a : a + SEQ]))
    if which == "chat":
        assert (
            ds.has_mask
            and max(p[0].size for p in pieces) <= SEQ
            and len(pieces) == ds.manifest.train.documents
        )
    assert len(segments) == len(pieces) and loader.num_windows < len(pieces)  # several documents per row
    expected = sorted((tuple(t), tuple(_alone(t, m)), tuple(range(t.size))) for t, m in pieces)
    assert sorted((tuple(t), tuple(lab), tuple(p)) for t, lab, p in segments) == expected
    assert padded >= 1  # rows are padded only at the end


def test_chat_without_packing_is_one_document_per_row(chat_dir):
    ds = TokenDataset(chat_dir)
    loader = DistributedBatchLoader(ds, SEQ, 4, seed=0)
    assert loader.layout == "documents" and loader.num_windows == ds.manifest.train.documents
    docs = {tuple(t): (t, m) for t, m in _documents(ds)}
    batch = next(loader)
    assert (
        batch.positions is None and batch.document_ids is None
    )  # padding only at the end: plain causal attention
    for row in range(4):
        tokens, labels = batch.tokens[row].numpy(), batch.labels[row].numpy()
        n = next(n for key, n in ((k, len(k)) for k in docs) if tuple(tokens[:n]) == key)
        doc, mask = docs[tuple(tokens[:n])]
        assert np.array_equal(labels[:n], _alone(doc, mask)) and set(labels[n:]) <= {IGNORE}


def test_document_mask_windows(text_dir):
    ds = TokenDataset(text_dir)
    plain = DistributedBatchLoader(ds, SEQ, 2, seed=5)
    masked = DistributedBatchLoader(ds, SEQ, 2, seed=5, document_mask=True)
    starts = set(ds.document_ends()[:-1].tolist())
    for _ in range(plain.steps_per_epoch):
        order = plain._epoch_order()[plain.offset : plain.offset + 2]
        a, b = next(plain), next(masked)
        assert a.positions is None and torch.equal(a.tokens, b.tokens)
        for row, window in enumerate(order):
            first = int(window) * SEQ
            boundary = np.array([first + t + 1 in starts for t in range(SEQ)])
            expect = np.where(boundary, IGNORE, a.labels[row].numpy())
            assert np.array_equal(b.labels[row].numpy(), expect)
            restart = np.array([t == 0 or first + t in starts for t in range(SEQ)])
            assert np.array_equal(b.document_ids[row].numpy(), np.cumsum(restart) - 1)
            last = np.maximum.accumulate(np.where(restart, np.arange(SEQ), 0))
            assert np.array_equal(b.positions[row].numpy(), np.arange(SEQ) - last)


def _fields(batch) -> list[torch.Tensor]:
    return [batch.tokens, batch.labels, batch.positions, batch.document_ids]


@pytest.mark.parametrize("packing", [True, False])
def test_resume_and_dealing_are_exact(chat_dir, packing):
    ds = TokenDataset(chat_dir)
    a = DistributedBatchLoader(ds, SEQ, 2, seed=7, packing=packing)
    steps = a.steps_per_epoch + 2  # across an epoch boundary
    for _ in range(3):
        next(a)
    b = DistributedBatchLoader(ds, SEQ, 2, seed=7, packing=packing)
    b.load_state_dict(a.state_dict())
    for _ in range(steps):
        for x, y in zip(_fields(next(a)), _fields(next(b))):
            assert (x is None and y is None) or torch.equal(x, y)
    one = DistributedBatchLoader(ds, SEQ, 2, seed=7, packing=packing)
    ranks = [DistributedBatchLoader(ds, SEQ, 1, r, 2, seed=7, packing=packing) for r in range(2)]
    for _ in range(steps):
        whole, parts = next(one), [next(r) for r in ranks]
        assert torch.equal(whole.tokens, torch.cat([p.tokens for p in parts]))
        assert torch.equal(whole.labels, torch.cat([p.labels for p in parts]))


def test_state_of_another_layout_is_refused(chat_dir):
    ds = TokenDataset(chat_dir)
    state = DistributedBatchLoader(ds, SEQ, 1, packing=True).state_dict()
    with pytest.raises(ValueError, match="packed rows but this run reads documents rows"):
        DistributedBatchLoader(ds, SEQ, 1).load_state_dict(state)


def test_long_chat_documents_are_refused_with_one_line(chat_dir):
    with pytest.raises(
        ValueError, match=r"\(train\): document \d+ has \d+ tokens, more than train.seq_len=16"
    ):
        DistributedBatchLoader(TokenDataset(chat_dir), 16, 1, packing=True)


def test_version_1_folders_load_as_before(text_dir, tmp_path):
    """A token-only folder of manifest version 1 gives the same plain windows; document masks need a re-prepare."""
    old = tmp_path / "old"
    shutil.copytree(text_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["version"] = 1
    for split in ("train", "val"):
        for key in ("mask", "ends", "trained_tokens"):
            manifest[split].pop(key, None)
    manifest.pop("rows")
    (old / "manifest.json").write_text(json.dumps(manifest))
    for ends in old.glob("*-ends.bin"):
        ends.unlink()
    new_loader = DistributedBatchLoader(TokenDataset(text_dir), SEQ, 2, seed=1)
    old_loader = DistributedBatchLoader(TokenDataset(old), SEQ, 2, seed=1)
    for _ in range(5):
        x, y = next(new_loader), next(old_loader)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels) and y.positions is None
    with pytest.raises(ValueError, match="without document boundaries; re-run `seektrain data prepare"):
        DistributedBatchLoader(TokenDataset(old), SEQ, 2, document_mask=True)


def test_training_data_follows_the_config(chat_dir):
    from seektrain.config.schema import JobConfig
    from seektrain.models.deepseek.presets import get_preset
    from seektrain.train.setup_data import open_training_data

    cfg = JobConfig()
    cfg.data.path, cfg.data.packing, cfg.data.prefetch = str(chat_dir), True, 0
    cfg.train.seq_len, cfg.train.micro_batch_size = SEQ, 2
    data = open_training_data(cfg, get_preset("tiny-dense"), 0, 1, True)
    try:
        assert data.loader.layout == "packed" and next(data.batches).packed
    finally:
        data.close()


def test_the_data_and_the_loss_agree_on_the_ignored_label():
    """data/ marks untrained labels with its own IGNORE (it imports nothing of models/); the model's loss
    skips its IGNORE: they must be one value."""
    from seektrain.data import batch

    assert batch.IGNORE == IGNORE == torch.nn.CrossEntropyLoss().ignore_index
