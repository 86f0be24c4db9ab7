"""A collective that failed (a dead, hung or unreachable rank): how it is told apart from other errors,
and how its one line names this rank and the peers it waits on.

Why: collectives have a finite timeout (``dist.collective_timeout_s``), and the backend's error (gloo's
"Timed out waiting 600000ms for recv operation" or "Connection closed by peer") names neither the rank
nor the node. A link between nodes that went down shows as such a timeout on every node, so the line
names every other node by host and address. ``is_collective_failure`` tells such an error by its type
and where it was thrown, never by its text.
"""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist

from seektrain.errors import RunFailure


class CollectiveError(RunFailure):
    """A collective timed out or lost a peer; the message names the rank and the operation."""


def where_text(facts: list[dict], rank: int) -> str:
    """' on HOST (ADDR)' for ``rank`` under a multi-node launch (its advertised address), else ''."""
    if rank >= len(facts) or not facts[rank].get("addr"):
        return ""
    return f" on {facts[rank]['host']} ({facts[rank]['addr']})"


def peers_text(facts: list[dict], rank: int, most: int = 3) -> str:
    """The ranks a collective of ``rank`` may wait on, by node, other nodes first: 'rank 1 on vm
    (10.0.0.2)', 'ranks 8-15 on b (10.0.0.2), ranks 1-7 on this node'. A timeout does not say which peer
    stopped answering, so every other node is named (up to ``most``, then a count)."""
    if len(facts) < 2 or rank >= len(facts):
        return "the other ranks"
    nodes: dict[tuple, list[int]] = {}
    for r, f in enumerate(facts):
        if r != rank:
            nodes.setdefault((f.get("host", "?"), f.get("addr", "")), []).append(r)
    own = (facts[rank].get("host", "?"), facts[rank].get("addr", ""))
    parts = [
        f"{_ranks(rs)} on {host}" + (f" ({addr})" if addr else "")
        for (host, addr), rs in nodes.items()
        if (host, addr) != own
    ]
    if len(parts) > most:
        parts = parts[:most] + [f"{len(parts) - most} more nodes"]
    if own in nodes:
        parts.append(f"{_ranks(nodes[own])} on this node")
    return ", ".join(parts)


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1-7', 'ranks 1, 4' (consecutive runs joined)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a backend's failure of a collective, told by its type and origin, never by its
    wording (which differs between backends and releases): torch's ``DistError`` family (NCCL raises
    ``DistBackendError``; the CPU policy's own gloo collectives raise ``DistNetworkError``), or a plain
    ``RuntimeError`` thrown by the native call of a collective, which is how gloo reports a timeout or a
    lost peer: the innermost Python frame is torch.distributed's (``distributed_c10d``, FSDP's, DTensor's)."""
    if isinstance(err, dist.DistError):
        return True
    if type(err) is not RuntimeError:
        return False
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_TORCH_DISTRIBUTED)
