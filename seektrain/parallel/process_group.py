"""Process-group set-up from the torchrun environment: NCCL on GPUs, gloo on CPU (``dist.backend``),
finite timeouts, the ``[dist]`` environment, and one check that every rank runs the same versions.

A run started without torchrun (no ``RANK`` in the environment) is a world of one and needs no
process group at all, except that DeviceMesh wants one: we create a single-rank gloo group on a
free local port so the same code path serves every world size, and end it with the run.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str = "gloo"
    facts: list = field(default_factory=list)  # every rank's versions and address (dist_env.node_facts)
    # the torchrun variables init_distributed set itself for a world of one (release_environment)
    own_env: tuple[str, ...] = ()
    own_group: bool = False  # init_distributed started the process group of that world of one

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(settings=None) -> DistEnv:
    """Initialise (once) and describe this process. ``settings`` is the config's ``[dist]`` section (a
    bare number is a collective timeout with the other keys at their defaults). The collective timeout
    bounds every collective, so a rank that hangs makes the others fail with a message naming the
    operation instead of waiting forever."""
    from seektrain.config.schema import DistSection
    from seektrain.parallel.dist_env import apply_settings, choose_backend, gather_node_facts

    if settings is None or isinstance(settings, (int, float)):
        settings = DistSection() if settings is None else DistSection(collective_timeout_s=float(settings))
    timeout_s = settings.collective_timeout_s
    apply_settings(settings)
    own_env: tuple[str, ...] = ()
    if "RANK" not in os.environ:
        single = dict(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
        os.environ.update(single)
        own_env = tuple(single)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    backend = choose_backend(settings.backend, cuda)
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    own_group = bool(own_env) and not dist.is_initialized()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
            **_restart_safe_store(rank, world, settings.init_timeout_s),
        )
    return DistEnv(rank, world, local_rank, device, backend, gather_node_facts(), own_env, own_group)


def release_environment(env: DistEnv) -> None:
    """Take back what ``init_distributed`` set up for a world of one, when the run ends (also by an
    error): a process that trains in-process (tests, notebooks) and later starts ``seektrain`` or
    torchrun children must not hand them its ``RANK`` and a ``MASTER_PORT`` its own process group still
    listens on (the children failed with EADDRINUSE), nor look "under a launcher" to its next in-process
    run; and the process group it started ends, so that the process is left as the run found it (a later
    run, or other code that starts a group of its own, would otherwise meet this one). A group that was
    there before the run, or one a launcher's workers share, is not ours to end."""
    for name in env.own_env:
        os.environ.pop(name, None)
    if env.own_group and dist.is_initialized():
        dist.destroy_process_group()


# [checkpoint/faults] elastic restarts -------------------------------------------------------------
def _restart_safe_store(rank: int, world: int, timeout_s: float) -> dict:
    """Under torchrun the workers share the agent's TCPStore, which outlives a restart: without a
    per-attempt prefix a restarted rank can read the previous attempt's (dead) peer addresses and
    fail with "Gloo connectFullMesh failed ... Connection refused" (measured: about one restart in
    two after a SIGKILL). Keys of attempt N live under ``seektrain/attempt_N/``. Across nodes the restart
    count differs (launch/rendezvous.py), so a multi-node launch exports one token per round instead."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("SEEKTRAIN_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return {
        "store": dist.PrefixStore(f"seektrain/attempt_{attempt}", store),
        "rank": rank,
        "world_size": world,
    }
