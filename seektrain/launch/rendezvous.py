"""The ``seektrain-c10d`` rendezvous: torchrun's c10d rendezvous plus one token per round for the workers.

Why: after a worker dies, every node's agent restarts its workers, but only the node whose worker failed
counts it as a restart; the others restart because a node is waiting (a membership change), so
``TORCHELASTIC_RESTART_COUNT`` differs between nodes. The workers share one TCP store across rounds
and must keep each round's keys apart (parallel/process_group.py ``_restart_safe_store``); with a
prefix taken from the restart count, the two nodes' workers wait under different prefixes and hang
(measured: two network namespaces, ``kill -9`` of node 1's worker). Here the agent of group rank 0
draws a token per round and publishes it in that round's own (fresh) rendezvous store; every agent
exports it to the workers it starts as ``SEEKTRAIN_ATTEMPT``.

It also compares the node counts: torchrun's c10d rendezvous never completes when nodes were given
different ``--nnodes`` and only says so as a timeout; the first node to reach the store records its count
and any other node with a different one stops at once, with one line.
"""

from __future__ import annotations

import os
import uuid

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

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._checked:
            self._check_node_count()
        info = self._inner.next_rendezvous()
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
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


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
