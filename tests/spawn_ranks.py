"""Start the ranks of an in-test distributed job: ``nprocs`` spawned processes, each a rank of one gloo
process group meeting at 127.0.0.1 on a free port picked here. Each rank starts as a torchrun worker
would (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, one thread) and has joined the
group before ``worker(rank, out_dir)`` runs; the group ends after it, also on an error (a group left
open can abort the process at exit). ``worker`` must be picklable: a module-level function, or a
``functools.partial`` of one."""

from __future__ import annotations

import datetime
import os
import socket

# Bounds every collective of a test's ranks: a rank that waits for a peer which will never come (a
# deadlock, a dead rank) fails the test in minutes rather than at torch's default of half an hour.
TIMEOUT_S = 300


def spawn_ranks(worker, nprocs: int, out_dir: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(worker, nprocs, port, out_dir), nprocs=nprocs, start_method="spawn")


def _rank(rank: int, worker, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        worker(rank, out_dir)
        dist.barrier()  # no rank tears gloo down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
