"""The NCCL_* / GLOO_* / MASTER_* / TORCH_* environment, with a remark on each risky value.

Why: a variable exported once while debugging (``NCCL_P2P_DISABLE=1``, ``NCCL_IB_DISABLE=1``) silently
makes every later job several times slower, and nothing in the job's own log says so.
"""

from __future__ import annotations

import os

from seektrain.doctor.check_report import Check

PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "TORCH_", "CUDA_VISIBLE_DEVICES")
_ON = ("1", "true", "yes", "on")
_LOCAL = ("localhost", "127.0.0.1", "::1", "0.0.0.0")

# (variable, predicate on the value, status, remark)
_RULES = [
    (
        "NCCL_P2P_DISABLE",
        lambda v: v.lower() in _ON,
        "warn",
        "peer-to-peer (NVLink/PCIe) off: intra-node collectives go through host memory, several times slower; "
        "unset it unless you are debugging a P2P hang",
    ),
    (
        "NCCL_IB_DISABLE",
        lambda v: v.lower() in _ON,
        "warn",
        "InfiniBand/RoCE off: inter-node traffic goes over TCP sockets, often 10x slower; unset it on an IB cluster",
    ),
    (
        "NCCL_SHM_DISABLE",
        lambda v: v.lower() in _ON,
        "warn",
        "shared-memory transport off: intra-node traffic without P2P goes through sockets; unset it",
    ),
    (
        "NCCL_NET_GDR_LEVEL",
        lambda v: v in ("0", "LOC"),
        "warn",
        "GPUDirect RDMA off: inter-node traffic is staged through host memory",
    ),
    (
        "NCCL_DEBUG",
        lambda v: v.upper() in ("INFO", "TRACE"),
        "warn",
        "verbose NCCL logging slows start-up and floods the logs of every rank; use WARN in production",
    ),
    ("NCCL_DEBUG_SUBSYS", lambda v: bool(v), "info", "NCCL logs these subsystems"),
    (
        "NCCL_ALGO",
        lambda v: bool(v),
        "warn",
        "forces NCCL's algorithm for every size; benchmark without it (seektrain doctor --comm) before keeping it",
    ),
    (
        "NCCL_PROTO",
        lambda v: bool(v),
        "warn",
        "forces NCCL's protocol; benchmark without it (seektrain doctor --comm) before keeping it",
    ),
    (
        "NCCL_BLOCKING_WAIT",
        lambda v: v.lower() in _ON,
        "warn",
        "deprecated name of TORCH_NCCL_BLOCKING_WAIT: every collective is waited for on the host (slower)",
    ),
    (
        "TORCH_NCCL_BLOCKING_WAIT",
        lambda v: v.lower() in _ON,
        "warn",
        "every collective is waited for on the host: slower steps; torch's default async error handling already "
        "ends a job whose collective times out",
    ),
    (
        "NCCL_ASYNC_ERROR_HANDLING",
        lambda v: True,
        "warn",
        "deprecated name: use TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ),
    (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        lambda v: v == "0",
        "warn",
        "a failed or timed-out collective hangs the job instead of ending it (dist.collective_timeout_s is then "
        "not enforced on NCCL); unset it",
    ),
    (
        "TORCH_DISTRIBUTED_DEBUG",
        lambda v: v.upper() == "DETAIL",
        "warn",
        "DETAIL checks every collective's arguments across ranks: much slower; use it only to debug a mismatch",
    ),
    ("TORCH_SHOW_CPP_STACKTRACES", lambda v: v.lower() in _ON, "info", "C++ stack traces in errors"),
    (
        "TORCH_NCCL_ENABLE_MONITORING",
        lambda v: v == "0",
        "warn",
        "the NCCL watchdog's heartbeat monitor is off: a stuck collective may hang the job without a report",
    ),
    (
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        lambda v: v.lower() in _ON,
        "info",
        "flight-recorder dumps on timeout (set TORCH_NCCL_TRACE_BUFFER_SIZE too)",
    ),
]


def environment_checks(multi_node: bool = False) -> list[Check]:
    """One row per variable set (risky ones with their remark) and a blocker for a MASTER_ADDR other
    nodes cannot reach or a MASTER_PORT that is no port."""
    env = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}
    if not env:
        return [Check("ok", "environment", "no NCCL_/GLOO_/MASTER_/TORCH_ variables set")]
    checks = []
    rules = {name: (test, status, remark) for name, test, status, remark in _RULES}
    for name in sorted(env):
        value = env[name]
        row = Check("info", f"env {name}", value)
        if name in rules and rules[name][0](value):
            row = Check(rules[name][1], f"env {name}", f"{value}: {rules[name][2]}")
        elif name == "MASTER_ADDR" and value in _LOCAL and (multi_node or _launched_multi_node()):
            row = Check(
                "blocker",
                f"env {name}",
                f"{value} on a multi-node job: the other nodes cannot reach "
                "it; use this node's address or hostname",
            )
        elif name == "MASTER_PORT" and not (value.isdigit() and 0 < int(value) < 65536):
            row = Check("blocker", f"env {name}", f"{value!r} is not a TCP port (1-65535)")
        checks.append(row)
    return checks


def _launched_multi_node() -> bool:
    """Under torchrun: more workers in the job than on this node."""
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    return world.isdigit() and local.isdigit() and int(world) > int(local)
