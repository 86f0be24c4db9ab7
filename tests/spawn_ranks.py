"""Start the ranks of an in-test distributed job: ``nprocs`` spawned processes that each call
``worker(rank, port, out_dir)`` and meet at 127.0.0.1:``port`` (a free port picked here)."""

from __future__ import annotations

import socket


def spawn_ranks(worker, nprocs: int, out_dir: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, out_dir), nprocs=nprocs, start_method="spawn")
