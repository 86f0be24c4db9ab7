"""The ``seektrain-c10d`` rendezvous: torchrun's c10d rendezvous plus one token per round for the workers.

Why: after a worker dies, every node's agent restarts its workers, but only the node whose worker failed
counts it as a restart; the others restart because a node is waiting (a membership change), so
``TORCHELASTIC_RESTART_COUNT`` differs between nodes. The workers share one TCP store across rounds
and must keep each round's keys apart (parallel/process_group.py ``_restart_safe_store``); with a
prefix taken from the restart count, the two nodes' workers wait under different prefixes and hang
(measured: two network namespaces, ``kill -9`` of node 1's worker). Here the agent of group rank 0
draws a token per round and publishes it in that round's own (fresh) rendezvous store; every agent
exports it to the workers it starts as ``SEEKTRAIN_ATTEMPT``.

The agent's calls to the store that are not the rendezvous itself are bounded: between its checks on
its own workers the agent asks the store whether new nodes wait (``num_nodes_waiting``), and on its way
out it closes the rendezvous (``shutdown``). When the link to the store's node is down, each such call
blocks for the store's read timeout (``--rdzv-timeout``, 300 s by default) and is retried, so the node
whose workers had already failed with one line kept its agent waiting for minutes, printing nothing
(measured: two network namespaces, the veth link taken down mid-run; the store's node ended in 9 s, the
other was still waiting 5 minutes later). Here both calls run in a background thread and the agent waits
for them at most a few seconds: a check still in flight counts as "nobody waits" (its answer is used by
the next check), a close that does not finish is left behind. A check the store refuses (its node's
agent has exited) counts as "nobody waits" too: the agent goes on watching its workers, whose own
failure names the lost peer (measured: node 1 said "could not reach the rendezvous store" instead of
its workers' line about an unshared run.dir, because node 0 had exited first).

After a round whose node count differs from the previous one's (a node lost or added under
``--nnodes MIN:MAX``) the agent says so in one line; torchrun itself only logs it at INFO, and the user
saw the workers start again with another world size and no word why.

It also compares the node counts: torchrun's c10d rendezvous never completes when nodes were given
different ``--nnodes`` and only says so as a timeout; the first node to reach the store records its count
and any other node with a different one stops at once, with one line.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

BACKEND = "seektrain-c10d"
ATTEMPT_VAR = "SEEKTRAIN_ATTEMPT"
_TOKEN_KEY = "seektrain/attempt_token"
_NODES_KEY = "seektrain/nnodes"
MONITOR_WAIT_S = 2.0  # the most one check for waiting nodes holds up the agent's check on its workers
CLOSE_WAIT_S = 2.0  # the most closing the rendezvous holds up the agent's exit


class NodeCountMismatch(RendezvousError):
    """Nodes of one job were started with different ``--nnodes``; the message is the user's one line."""


def node_spec(min_nodes: int, max_nodes: int) -> str:
    return str(min_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"


class RoundTokenRendezvous(RendezvousHandler):
    """Delegates to the c10d handler; checks the node count against the store's first, and after each
    rendezvous puts the round's token into the environment."""

    def __init__(self, inner: RendezvousHandler, store=None, nodes: str = ""):
        self._inner, self._store, self._nodes = inner, store, nodes
        self._checked = store is None
        self._monitor = BoundedCall()  # the agent's periodic num_nodes_waiting
        self._nodes_before: int | None = None  # the previous round's node count

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._checked:
            self._check_node_count()
        info = self._inner.next_rendezvous()
        if self._nodes_before not in (None, info.world_size):  # a node was lost or joined (--nnodes MIN:MAX)
            print(
                f"seektrain: the group re-formed with {info.world_size} node{'s' * (info.world_size > 1)} "
                f"(was {self._nodes_before}); the workers restart and resume from the last checkpoint, "
                "resharded to the new world size",
                file=sys.stderr,
                flush=True,
            )
        self._nodes_before = info.world_size
        if info.rank == 0:
            info.store.set(_TOKEN_KEY, uuid.uuid4().hex[:12])
        os.environ[ATTEMPT_VAR] = info.store.get(_TOKEN_KEY).decode()  # the spawned workers inherit it
        return info

    def _check_node_count(self) -> None:
        key = f"{_NODES_KEY}/{self._inner.get_run_id()}"
        first = self._store.compare_set(key, "", self._nodes).decode()  # sets it when no node has yet
        if first != self._nodes:
            raise NodeCountMismatch(
                f"this node was started with --nnodes {self._nodes} but the nodes already at "
                f"the rendezvous with --nnodes {first}; start every node with the same --nnodes"
            )
        self._checked = True

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        try:
            return self._monitor.result(self._inner.num_nodes_waiting, MONITOR_WAIT_S, 0)
        except RendezvousError:  # the store's node is gone: its workers' failure line says more than ours
            return 0

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return BoundedCall().result(self._inner.shutdown, CLOSE_WAIT_S, False)


class BoundedCall:
    """One call at a time in a daemon thread, waited for at most ``wait_s`` per ``result``: the call's
    value (or its exception) once it returned, else ``fallback`` while it is still in flight (a later
    ``result`` collects it instead of starting another)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._box: dict = {}

    def result(self, call: Callable, wait_s: float, fallback):
        if self._thread is None:
            box: dict = {}

            def run():
                try:
                    box["value"] = call()
                except BaseException as err:  # handed to the caller, in its thread
                    box["error"] = err

            self._box, self._thread = box, threading.Thread(target=run, daemon=True)
            self._thread.start()
        self._thread.join(wait_s)
        if self._thread.is_alive():
            return fallback
        self._thread, box = None, self._box
        if "error" in box:
            raise box["error"]
        return box["value"]


def _create(params: RendezvousParameters) -> RendezvousHandler:
    """What torchrun's own c10d creator does (backend and store, then the handler), keeping the store."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    c10d = RendezvousParameters(
        "c10d",
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **params.config,
    )
    backend, store = create_backend(c10d)
    return RoundTokenRendezvous(
        create_handler(store, backend, c10d), store, node_spec(params.min_nodes, params.max_nodes)
    )


def register() -> None:
    """Make ``--rdzv-backend=seektrain-c10d`` known to torchrun in this (agent) process (registering the
    same creator twice is allowed)."""
    rendezvous_handler_registry.register(BACKEND, _create)
