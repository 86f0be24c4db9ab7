"""Block checksums by position, through the real loader (issue 35): folders prepared by ``prepare_dataset``
(the path of ``seektrain data prepare``) whose shards hold three full blocks of ``BLOCK_TOKENS`` elements
and a short fourth, and a last shard that is one short block. One byte is damaged in turn in the first,
a middle, the last full and the last partial block, and in the one-block shard, of a token shard (a text
folder read as windows, a chat folder read as documents) and of a loss-mask shard (the chat folder).
A fresh ``DistributedBatchLoader`` then runs one epoch over the folder: it must stop with
``ShardDamaged`` naming the shard file, the block and its byte range, computed here from the file's
size, not by the code under test."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.blocks import BLOCK_TOKENS, ShardDamaged
from seektrain.data.dataset import TokenDataset
from seektrain.data.prepare import prepare_dataset

SHARD = 3 * BLOCK_TOKENS + 100  # shard_tokens: three full blocks and a short one of 100
TAIL = 300  # at least this many tokens in the last shard, which stays one short block
SEQ_LEN = {"text": 256, "chat": 64}
CHAT_ROW = 62  # tokens of one chat row below (byte tokenizer, the default completion template)

# (name, shard index (-1: the last), block within it); the last shard is one partial block
POSITIONS = [
    ("first", 0, 0),
    ("middle", 1, 1),
    ("last-full", 0, 2),
    ("last-partial", 1, 3),
    ("one-block-shard", -1, 0),
]
STREAMS = [("text", "bin"), ("chat", "bin"), ("chat", "mask")]


def _epoch(folder: Path) -> int:
    """Run one epoch of the real loader over ``folder``; returns the batches it gave."""
    kind = "chat" if (folder / "shard-00000.mask").exists() else "text"
    loader = DistributedBatchLoader(TokenDataset(folder), SEQ_LEN[kind], micro_batch_size=1)
    for _ in range(loader.steps_per_epoch):
        next(loader)
    return loader.steps_per_epoch


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("blocks")
    folders = {}
    text = root / "text.jsonl"  # 100-token documents (99 bytes and eos)
    docs = math.ceil((2 * SHARD + TAIL) / 100)
    text.write_text("".join(json.dumps({"text": "x" * 99}) + "\n" for _ in range(docs)))
    chat = root / "chat.jsonl"
    rows = math.ceil((2 * SHARD + TAIL) / CHAT_ROW)
    chat.write_text(
        "".join(
            json.dumps({"prompt": f"q{i:04d} " * 5, "completion": f"a{i:04d} " * 5}) + "\n"
            for i in range(rows)
        )
    )
    for kind, source in (("text", text), ("chat", chat)):
        folders[kind] = root / kind
        prepare_dataset([source], folders[kind], "byte", shard_tokens=SHARD, val_fraction=0.0)
        sizes = [
            s["tokens"] for s in json.loads((folders[kind] / "manifest.json").read_text())["train"]["shards"]
        ]
        assert sizes[:2] == [SHARD, SHARD] and 0 < sizes[2] < BLOCK_TOKENS and len(sizes) == 3, sizes
        assert _epoch(folders[kind]) > 0  # the clean folder reads through
    return folders


@pytest.mark.parametrize("where,shard_index,block", POSITIONS, ids=[p[0] for p in POSITIONS])
@pytest.mark.parametrize("kind,suffix", STREAMS, ids=[f"{k}-{s}" for k, s in STREAMS])
def test_damage_in_every_block_position_is_found_and_named(
    prepared, tmp_path: Path, kind, suffix, where, shard_index, block
) -> None:
    folder = tmp_path / kind
    shutil.copytree(prepared[kind], folder)
    shards = sorted(folder.glob(f"shard-0*.{suffix}"))
    path = shards[shard_index]
    itemsize = 1 if suffix == "mask" else 2  # uint8 mask, uint16 tokens (vocabulary 259)
    data = bytearray(path.read_bytes())
    elements = len(data) // itemsize
    lo, hi = block * BLOCK_TOKENS, min((block + 1) * BLOCK_TOKENS, elements)
    partial = hi - lo < BLOCK_TOKENS
    assert partial == (where in ("last-partial", "one-block-shard")), (where, lo, hi)
    assert hi == elements or where not in ("last-partial", "one-block-shard")
    element = lo + 7
    data[element * itemsize + itemsize - 1] ^= 0xFF
    path.write_bytes(data)

    try:
        _epoch(folder)
    except ShardDamaged as caught:
        line = str(caught)
    else:
        pytest.fail(f"{where}: block {block} of {path.name} (element {element} damaged) read unnoticed")
    expected = (
        f"{path}: block {block} (bytes {lo * itemsize}-{hi * itemsize - 1}) does not match its checksum"
    )
    assert line.startswith(expected), (
        f"damaged {where} block of {path.name}: expected {expected!r}, got {line!r}"
    )
    assert f"in {path.name}.crc" in line and "\n" not in line
