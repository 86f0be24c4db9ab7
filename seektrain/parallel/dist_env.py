"""The ``[dist]`` settings applied to a process, the versions every rank must share, and ``env.json``.

Why here and not only in the launcher: a worker may be started by ``seektrain train``, by plain
``torchrun`` or by ``srun``; each applies the same settings just before its process group starts (the
backends read their variables then). Auto-detected values never override what the user exported;
values written in the config do.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.errors import UserError

log = logging.getLogger("seektrain.dist")

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# set by the launcher for its workers: what it detected (never a user's choice)
AUTO_IFNAME_VAR, LOCAL_ADDR_VAR = "SEEKTRAIN_AUTO_IFNAME", "SEEKTRAIN_LOCAL_ADDR"
LAUNCH_VAR = "SEEKTRAIN_LAUNCH"  # the node's own --nnodes/--nproc-per-node, compared across nodes at start-up


def choose_backend(requested: str, cuda: bool) -> str:
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not cuda:
        raise UserError(
            "dist.backend=nccl needs CUDA GPUs and this process sees none; use dist.backend=auto or gloo"
        )
    return requested


def worker_environment(settings, environ: dict[str, str], auto_ifname: str | None) -> dict[str, str]:
    """The variables to set for ``settings`` (a DistSection): ``dist.env`` and ``dist.socket_ifname``
    always; an auto-detected interface only for variables the environment does not set yet."""
    from seektrain.config.loader import dist_env_vars

    out = dist_env_vars(settings.env)
    ifname = settings.socket_ifname or None
    for var in IFNAME_VARS:
        if ifname:
            out[var] = ifname
        elif auto_ifname and var not in environ and var not in out:
            out[var] = auto_ifname
    return out


def apply_settings(settings) -> None:
    """Put ``[dist]``'s variables into this process's environment before the process group starts."""
    os.environ.update(worker_environment(settings, dict(os.environ), os.environ.get(AUTO_IFNAME_VAR)))


def versions() -> dict[str, str | None]:
    from seektrain.version import version

    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "seektrain": version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
    }


def node_label() -> str:
    """This node as the others know it: the host name, plus the address a multi-node launch advertises
    (host names can repeat across nodes, e.g. containers or network namespaces on one machine)."""
    addr = os.environ.get(LOCAL_ADDR_VAR, "")
    return f"{socket.gethostname()} ({addr})" if addr else socket.gethostname()


def node_facts() -> dict:
    """What this rank tells the others at start-up: its versions and where it runs."""
    return {
        "versions": versions(),
        "host": socket.gethostname(),
        "addr": os.environ.get(LOCAL_ADDR_VAR, ""),
        "ifname": {v: os.environ[v] for v in IFNAME_VARS if v in os.environ},
        "launch": os.environ.get(LAUNCH_VAR, ""),
    }


def mismatched_versions(facts: list[dict]) -> str | None:
    """One line naming the ranks whose seektrain or torch differ from rank 0's, or None when all agree."""
    for package in ("seektrain", "torch"):
        want = facts[0]["versions"][package]
        odd = [(r, f) for r, f in enumerate(facts) if f["versions"][package] != want]
        if odd:
            others = ", ".join(f"rank {r} on {f['host']} has {f['versions'][package]}" for r, f in odd[:4])
            return (
                f"mixed {package} versions across nodes: rank 0 on {facts[0]['host']} has {want}, {others}; "
                f"install the same {package} on every node"
            )
    return None


def mismatched_launch(facts: list[dict]) -> str | None:
    """One line naming the nodes started with other launch options than rank 0's node, or None. The
    rendezvous completes on the store host's node count, so a node given another ``--nnodes`` (or
    ``--nproc-per-node``) would otherwise train in a world it did not ask for."""
    want = facts[0].get("launch", "")
    name = lambda f: f"{f['host']} ({f['addr']})" if f.get("addr") else f["host"]  # noqa: E731
    odd = {
        name(f): f.get("launch") or "no launcher" for f in facts if f.get("launch", "") != want
    }  # one per node
    if not odd:
        return None
    others = ", ".join(f"{node} was started with {launch}" for node, launch in list(odd.items())[:4])
    return (
        f"nodes were started with different launch options: {name(facts[0])} (rank 0) with "
        f"{want or 'no launcher'}, {others}; start every node with the same --nnodes and --nproc-per-node"
    )


def gather_node_facts() -> list[dict]:
    """Every rank's ``node_facts`` (one small collective right after the process group starts); a
    version or launch-option mismatch is a ValueError of one line on every rank, before any model is built."""
    facts = [node_facts()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        facts = [{} for _ in range(dist.get_world_size())]  # placeholders: all_gather_object replaces each
        dist.all_gather_object(facts, node_facts())
    problem = mismatched_versions(facts) or mismatched_launch(facts)
    if problem:
        raise UserError(problem)
    return facts


def write_env_file(run_dir: str | Path, backend: str, facts: list[dict], settings) -> None:
    """``run.dir/env.json``: versions, backend, interfaces, addresses and the dist settings (rank 0)."""
    from dataclasses import asdict

    report = {
        "versions": facts[0]["versions"],
        "backend": backend,
        "master": {"addr": os.environ.get("MASTER_ADDR"), "port": os.environ.get("MASTER_PORT")},
        "ranks": [
            {"rank": r, "host": f["host"], "addr": f["addr"], "ifname": f["ifname"]}
            for r, f in enumerate(facts)
        ],
        "dist": asdict(settings),
    }
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    from seektrain.checkpoint.atomic import write_text_atomic

    write_text_atomic(path / "env.json", json.dumps(report, indent=1))
