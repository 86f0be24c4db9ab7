"""The ``seektrain-c10d`` rendezvous: torchrun's c10d rendezvous plus one token per round for the workers.

Why: after a worker dies, every node's agent restarts its workers, but only the node whose worker failed
counts it as a restart; the others restart because a node is waiting (a membership change), so
``TORCHELASTIC_RESTART_COUNT`` differs between nodes. The workers share one TCP store across rounds
and must keep each round's keys apart (parallel/distributed.py ``_restart_safe_store``); with a
prefix taken from the restart count, the two nodes' workers wait under different prefixes and hang
(measured: two network namespaces, ``kill -9`` of node 1's worker). Here the agent of group rank 0
draws a token per round and publishes it in that round's own (fresh) rendezvous store; every agent
exports it to the workers it starts as ``SEEKTRAIN_ATTEMPT``.
"""

from __future__ import annotations

import os
import uuid

from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo, RendezvousParameters,
                                                  rendezvous_handler_registry)

BACKEND = "seektrain-c10d"
ATTEMPT_VAR = "SEEKTRAIN_ATTEMPT"
_TOKEN_KEY = "seektrain/attempt_token"


class RoundTokenRendezvous(RendezvousHandler):
    """Delegates to the c10d handler; after each rendezvous puts the round's token into the environment."""

    def __init__(self, inner: RendezvousHandler):
        self._inner = inner

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        if info.rank == 0:
            info.store.set(_TOKEN_KEY, uuid.uuid4().hex[:12])
        os.environ[ATTEMPT_VAR] = info.store.get(_TOKEN_KEY).decode()  # the spawned workers inherit it
        return info

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
    c10d = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
                                params.local_addr, **params.config)
    return RoundTokenRendezvous(rendezvous_handler_registry.create_handler(c10d))


def register() -> None:
    """Make ``--rdzv-backend=seektrain-c10d`` known to torchrun in this (agent) process (registering the
    same creator twice is allowed)."""
    rendezvous_handler_registry.register(BACKEND, _create)
