"""What the per-block checksums (seektrain/data/blocks.py) cost the loader: tokens/s of the same batches
with and without them, side by side.

Two folders share the same shard files (hard links, so one page cache): one with its ``.crc`` files
and a version 3 manifest, one with a version 2 manifest (no block checksums). The rounds interleave
the two, so a neighbour's load on a shared machine hits both sides alike; the figure per side is the
median of its rounds. The shards are read once first, so this is the CPU cost on data in the page
cache (the extra bytes read from disk are at most one block on either side of a window).

    python benchmarks/bench_data_checksum.py [--tokens 33554432] [--rounds 7] [--batches 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.blocks import BLOCK_TOKENS
from seektrain.data.dataset import TokenDataset
from seektrain.data.manifest import Manifest, Split, TokenizerInfo, write_manifest
from seektrain.data.prepare import ShardWriter


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def make_folders(root: Path, tokens: int, dtype: str, vocab: int) -> tuple[Path, Path]:
    """(checked, unchecked): the same random tokens in 256 MiB shards."""
    checked, unchecked = root / f"checked-{dtype}", root / f"unchecked-{dtype}"
    checked.mkdir()
    unchecked.mkdir()
    np_dtype = np.dtype(dtype).newbyteorder("<")
    writer = ShardWriter(checked, "shard", np_dtype, (256 << 20) // np_dtype.itemsize)
    rng = np.random.default_rng(0)
    for lo in range(0, tokens, 1 << 22):
        writer.write(rng.integers(0, vocab, min(1 << 22, tokens - lo)))
    shards = writer.close()
    info = TokenizerInfo("bench", vocab, 0, None, "bench")
    write_manifest(checked, Manifest(info, dtype, Split(shards, tokens, 1), Split(), 0.0))
    d = json.loads((checked / "manifest.json").read_text())
    d["version"], d["block_tokens"] = 2, None
    for shard in d["train"]["shards"]:
        shard["blocks"] = None
        os.link(checked / shard["file"], unchecked / shard["file"])
    (unchecked / "manifest.json").write_text(json.dumps(d))
    return checked, unchecked


def tokens_per_s(folder: Path, seq_len: int, micro_batch: int, batches: int, epoch: int) -> float:
    loader = DistributedBatchLoader(TokenDataset(folder), seq_len, micro_batch, seed=epoch)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * micro_batch * seq_len / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 25)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    args = ap.parse_args()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical cores); block = {BLOCK_TOKENS} elements")
    print(f"{'data':<24}{'seq_len':>8}{'checked tok/s':>16}{'unchecked tok/s':>18}{'ratio':>8}")
    with tempfile.TemporaryDirectory(prefix="bench-data-checksum-") as tmp:
        for dtype, vocab, seq_lens in [("uint16", 50_000, (2048,)), ("uint32", 129_280, (512, 4096))]:
            pair = make_folders(Path(tmp), args.tokens, dtype, vocab)
            for folder in pair:  # into the page cache
                TokenDataset(folder).read(0, args.tokens)
            for seq_len in seq_lens:
                sides: dict[Path, list[float]] = {folder: [] for folder in pair}
                for r in range(args.rounds):
                    for folder in pair if r % 2 == 0 else pair[::-1]:
                        sides[folder].append(tokens_per_s(folder, seq_len, args.micro_batch, args.batches, r))
                on, off = (statistics.median(sides[folder]) for folder in pair)
                label = f"{args.tokens / 1e6:.0f}M {dtype} tokens"
                print(f"{label:<24}{seq_len:>8}{on:>16,.0f}{off:>18,.0f}{on / off:>8.2f}")


if __name__ == "__main__":
    main()
