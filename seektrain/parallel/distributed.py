"""Process-group set-up from the torchrun environment: NCCL on GPUs, gloo on CPU, finite timeouts.

A run started without torchrun (no ``RANK`` in the environment) is a world of one and needs no
process group at all, except that DeviceMesh wants one: we create a single-rank gloo group on a
free local port so the same code path serves every world size.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0) -> DistEnv:
    """Initialise (once) and describe this process. The timeout bounds every collective, so a rank that
    hangs makes the others fail with a message naming the operation instead of waiting forever."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None,
                                **_restart_safe_store(rank, world, timeout_s))
    return DistEnv(rank, world, local_rank, device)


# [checkpoint/faults] elastic restarts -------------------------------------------------------------
def _restart_safe_store(rank: int, world: int, timeout_s: float) -> dict:
    """Under torchrun the workers share the agent's TCPStore, which outlives a restart: without a
    per-attempt prefix a restarted rank can read the previous attempt's (dead) peer addresses and
    fail with "Gloo connectFullMesh failed ... Connection refused" (measured: about one restart in
    two after a SIGKILL). Keys of attempt N live under ``seektrain/attempt_N/``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return {"store": dist.PrefixStore(f"seektrain/attempt_{attempt}", store), "rank": rank, "world_size": world}

