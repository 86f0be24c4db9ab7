"""Start-up proof that every rank sees the run.dir rank 0 sees.

Why: checkpoints are written by every rank into one folder that rank 0 then hashes and commits, and
resuming reads what rank 0 chose. On nodes that each have their own local folder at the run.dir path,
every node trained happily and the job failed at its first checkpoint, hours in, with a line about RNG
state. Here rank 0 writes a marker file holding a random token under a name no node has looked up
before (so no cached "no such file" answer of a network file system hides it), every rank reads it
from its own run.dir, and the ranks compare what they read before the first step. A rank that does not
see it stops the whole job at once with one line naming its node and the folder.
"""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

import torch.distributed as dist

from seektrain.checkpoint.atomic import write_text_atomic
from seektrain.checkpoint.storage import describe_error
from seektrain.errors import UserError

MARKER_PREFIX = ".seektrain-shared-"
READ_FOR_S = 3.0  # a network file system may show a new file a moment late: retry this long


def read_marker(path: Path) -> str | None:
    """The marker's text as this rank sees it, or None (the tests' fault injection redirects it)."""
    try:
        return path.read_text()
    except OSError:
        return None


def check_shared_run_dir(run_dir: Path, rank: int, group) -> None:
    """Collective over ``group`` (every rank of the job); nothing to prove without one or on one rank.
    ``UserError`` on every rank, the same line, when a rank reads another token or none."""
    if group is None or dist.get_world_size(group) == 1:
        return
    run_dir = Path(run_dir)
    token = secrets.token_hex(16)
    box: list = [token, ""]
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(run_dir / f"{MARKER_PREFIX}{token}", token)
        except OSError as err:
            box[1] = describe_error(err)
    dist.broadcast_object_list(box, src=0, group=group)
    token, problem = box
    if problem:
        raise UserError(
            f"run.dir={run_dir}: rank 0 cannot write in it ({problem}); check that it is writable"
        )
    marker = run_dir / f"{MARKER_PREFIX}{token}"
    deadline = time.monotonic() + READ_FOR_S
    while (seen := read_marker(marker)) != token and time.monotonic() < deadline:
        time.sleep(0.2)
    views: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (seen == token, socket.gethostname(), str(run_dir)), group=group)
    if rank == 0:  # every rank has read it
        marker.unlink(missing_ok=True)
    _, host0, dir0 = views[0]
    blind = [
        f"rank {r} on node {host}" + (f" (its run.dir: {path})" if path != dir0 else "")
        for r, (ok, host, path) in enumerate(views)
        if not ok
    ]
    if blind:  # the same line on every rank
        raise UserError(
            f"run.dir={dir0} is not shared: {', '.join(blind[:4])} cannot see the marker file rank 0 "
            f"(node {host0}) wrote there; put run.dir on storage every node mounts at the same path "
            "(NFS, Lustre, a shared volume)"
        )
