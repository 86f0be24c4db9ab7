"""Per-rank random-number-generator states, stored as raw bytes files (never pickled).

Why files and not the DCP state: DCP treats a plain tensor as replicated and keeps one copy, but RNG
states differ per rank; and pickle would make a checkpoint able to run code on load. So each rank
writes ``rng-rankRRRRR.cpu`` (``torch.get_rng_state()``) and, on GPUs, ``rng-rankRRRRR.cuda`` (the
current device's generator) next to the DCP shards; they are covered by the checksums like every file.

On resume a rank restores the files of the same rank number. When the world size changed (resharding)
a rank with no file keeps the state seeded from ``train.seed``: our training step draws no random
numbers today (no dropout), so this affects nothing but is reported at INFO level.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("seektrain.checkpoint")


def _name(rank: int, kind: str) -> str:
    return f"rng-rank{rank:05d}.{kind}"


def capture() -> dict[str, bytes]:
    """This process's generator states, by kind (``cpu``, ``cuda``)."""
    states = {"cpu": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return states


def write(folder: Path, rank: int, states: dict[str, bytes]) -> None:
    for kind, data in states.items():
        path = Path(folder) / _name(rank, kind)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def restore(folder: Path, rank: int) -> bool:
    """Load this rank's generator states from ``folder``; False when the checkpoint has none for it."""
    cpu = Path(folder) / _name(rank, "cpu")
    if not cpu.is_file():
        log.info(
            "checkpoint %s has no RNG state for rank %d (saved with fewer ranks); keeping the seeded state",
            Path(folder).name,
            rank,
        )
        return False
    torch.set_rng_state(_tensor(cpu.read_bytes()))
    cuda = Path(folder) / _name(rank, "cuda")
    if cuda.is_file() and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor(cuda.read_bytes()))
    return True
