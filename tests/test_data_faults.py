"""A shard damaged while a run reads it (issue 22, item 4): found by its block checksum before any step
uses it, every rank stops with the same one line naming the file, the block and the fix, the
checkpoints stay, and once the file is restored the run resumes exactly.

The unit tests hold the block check itself: every damaged byte is found in the block that holds it and
nowhere else, the bytes handed out are the bytes checked, and folders prepared before block checksums
(manifest version 2) still load."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from fault_injection import hooks_env
from run_cli import metrics, train
from seektrain.data.agreed import NONE, AgreedBatches
from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.blocks import BLOCK_TOKENS, BlockSums, ShardDamaged
from seektrain.data.dataset import TokenDataset, verify_dataset
from seektrain.data.prepare import prepare_dataset

TOKENS = 3 * BLOCK_TOKENS + 100  # per shard: three full blocks and a short one


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """300 byte-tokenized documents: training shards of TOKENS tokens, 30 held out for validation."""
    text = tmp_path / "in.jsonl"
    text.write_text(
        "".join(json.dumps({"text": f"doc {i}: the quick brown fox " * 10}) + "\n" for i in range(300))
    )
    prepare_dataset([text], tmp_path / "data", "byte", shard_tokens=TOKENS, val_fraction=0.1)
    return tmp_path / "data"


def flip(path: Path, byte: int) -> None:
    data = bytearray(path.read_bytes())
    data[byte] ^= 0xFF
    path.write_bytes(data)


def test_block_sums_are_crc32_of_each_block_whatever_the_pieces() -> None:
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    sums = BlockSums(4096)
    for lo, hi in [(0, 1), (1, 4095), (4095, 4097), (4097, 9000), (9000, 10_000)]:
        sums.update(data[lo:hi])
    expected = [zlib.crc32(data[i : i + 4096]) for i in range(0, 10_000, 4096)]
    assert sums.finish().tolist() == expected  # two full blocks and a short one


def test_a_damaged_byte_fails_exactly_the_reads_of_its_block(folder: Path) -> None:
    ds = TokenDataset(folder)
    assert ds.block_checked and ds.manifest.version == 3 and ds.manifest.block_tokens == BLOCK_TOKENS
    clean = ds.read(0, len(ds)).copy()
    shard = folder / ds.shards[1].file
    token = 2 * BLOCK_TOKENS + 7  # in block 2 of shard 1
    flip(shard, 2 * token + 1)  # the high byte of a uint16 token
    block_lo, block_hi = TOKENS + 2 * BLOCK_TOKENS, TOKENS + 3 * BLOCK_TOKENS
    for start, length in [(TOKENS + token, 1), (block_lo, 1), (block_hi - 1, 1), (block_lo - 5, 10)]:
        with pytest.raises(ShardDamaged) as caught:
            ds.read(start, length)
        line = str(caught.value)
        assert line.startswith(f"{shard}: block 2 (bytes {4 * BLOCK_TOKENS}-{6 * BLOCK_TOKENS - 1}) ")
        assert "restore the file or re-run `seektrain data prepare ... --force`" in line
        assert "\n" not in line and caught.value.code == 4 + 2  # shard 0 has blocks 0-3
        assert str(ds.damage(caught.value.code)) == line  # what another rank rebuilds from the code
    # the neighbours of the damaged block still read, and give the prepared tokens
    for start, length in [(block_lo - 64, 64), (block_hi, 64), (TOKENS - 3, 40), (0, TOKENS)]:
        assert np.array_equal(ds.read(start, length), clean[start : start + length])
    with pytest.raises(ValueError, match="sha256 mismatch"):
        verify_dataset(folder)


def test_what_is_handed_out_is_the_checked_copy(folder: Path) -> None:
    """Damage arriving after a read cannot reach what the read returned."""
    ds = TokenDataset(folder)
    window = ds.read(100, 64)
    before = window.copy()
    flip(folder / ds.shards[0].file, 2 * 110)
    assert not isinstance(window, np.memmap) and np.array_equal(window, before)


def test_a_damaged_checksum_file_or_mask_stops_too(tmp_path: Path) -> None:
    rows = tmp_path / "chat.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"q{i} " * 20, "completion": f"a{i} " * 20}) + "\n" for i in range(40))
    )
    prepare_dataset([rows], tmp_path / "data", "byte", val_fraction=0.0)
    ds = TokenDataset(tmp_path / "data")
    assert ds.has_mask and ds.block_checked
    flip(tmp_path / "data" / "shard-00000.mask", 3)
    with pytest.raises(ShardDamaged, match=r"shard-00000\.mask: block 0 \(bytes 0-"):
        ds.read_mask(0, 4)
    assert ds.read(0, 4).size == 4  # the token shard itself is fine
    flip(tmp_path / "data" / "shard-00000.bin.crc", 0)
    with pytest.raises(ShardDamaged, match=r"shard-00000\.bin: block 0 "):
        ds.read(0, 4)


def test_document_ends_are_checked_once_and_kept_in_memory(folder: Path) -> None:
    ds = TokenDataset(folder)
    ends = ds.document_ends()
    assert not isinstance(ends, np.memmap)
    flip(folder / "shard-ends.bin", 0)
    assert ds.document_ends() is ends  # the run keeps the copy it checked
    with pytest.raises(ValueError, match=r"shard-ends\.bin: sha256 mismatch"):
        TokenDataset(folder).document_ends()


def test_folders_prepared_before_block_checksums_still_load(folder: Path) -> None:
    """A version 2 manifest (no ``blocks``, no ``block_tokens``): sizes are checked, reads are not."""
    path = folder / "manifest.json"
    d = json.loads(path.read_text())
    d["version"] = 2
    del d["block_tokens"]
    for split in ("train", "val"):
        for shard in d[split]["shards"]:
            del shard["blocks"]
        d[split]["ends"].pop("blocks")
    path.write_text(json.dumps(d))
    for crc in folder.glob("*.crc"):
        crc.unlink()
    ds = TokenDataset(folder)
    assert not ds.block_checked
    clean = ds.read(0, 64).copy()
    flip(folder / ds.shards[0].file, 0)
    assert ds.read(0, 64)[0] != clean[0]  # not noticed: what such a folder gets
    with pytest.raises(ValueError, match="sha256 mismatch"):
        verify_dataset(folder)  # `seektrain data verify` still finds it


def test_a_manifest_whose_blocks_do_not_fit_its_shard_is_refused(folder: Path) -> None:
    path = folder / "manifest.json"
    d = json.loads(path.read_text())
    d["train"]["shards"][0]["blocks"]["tokens"] += 1
    path.write_text(json.dumps(d))
    with pytest.raises(
        ValueError, match=r"field 'train.shards\[0\].blocks.tokens' is not the number of blocks"
    ):
        TokenDataset(folder)


def test_ranks_agree_on_the_first_damaged_block(folder: Path, monkeypatch) -> None:
    """The exchange without a process group: the MIN over ranks decides, and every rank raises it."""
    ds = TokenDataset(folder)
    loader = DistributedBatchLoader(ds, 64, 2)
    agreed = AgreedBatches(loader, group=None)
    others = [NONE]

    def all_reduce(tensor, op, group):
        tensor.fill_(min(int(tensor), *others))

    monkeypatch.setattr("torch.distributed.all_reduce", all_reduce)
    assert next(agreed).tokens.shape == (2, 64)  # nobody found damage
    others[:] = [5]  # another rank met block 5 of this split
    with pytest.raises(ShardDamaged) as caught:
        next(agreed)
    assert caught.value.code == 5 and str(caught.value) == str(ds.damage(5))


def test_a_shard_damaged_mid_run_stops_both_ranks_before_a_step_uses_it(tmp_path: Path, folder: Path) -> None:
    """2 processes: rank 1 flips a byte of the shard under its share of global batch 4 just before
    reading it. Both ranks stop with the same line before step 4; the async save of step 2 is committed
    first; with the file restored the run resumes from it and step 3 repeats exactly. The run evaluates
    too, so the val batches' agreement runs as well."""
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)
    run = tmp_path / "run"
    common = (
        f"data.path={folder}",
        "checkpoint.interval=2",
        "checkpoint.async_save=true",  # step 2's save is still uncommitted when batch 4 is refused
        "train.eval_interval=2",
        "train.eval_steps=1",
    )
    proc = train(
        run,
        "train.steps=5",
        *common,
        nproc=2,
        env=hooks_env({"SEEKTRAIN_TEST_DATA_DAMAGE": "4:1"}),
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    flipped = re.search(r"flipped byte (\d+) of (\S+) \(block (\d+)\)", proc.stderr)
    assert flipped, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("seektrain: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"{folder / flipped[2]}: block {flipped[3]} (bytes " in lines[0]
    assert lines[0].endswith("[ranks 0, 1]") and "Traceback" not in proc.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]  # no step trained on batch 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]
    first = {r["step"]: r["loss"] for r in metrics(run)}

    shutil.copy2(pristine / flipped[2], folder / flipped[2])  # the user restores the file
    train(run, "train.steps=5", *common, nproc=2)
    resumed = metrics(run)[3:]
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert resumed[0]["loss"] == first[3]  # the same weights and the same batch: exact
