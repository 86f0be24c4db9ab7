"""Running the real ``seektrain`` CLI on two "hosts" (tests/netns.py), shared by the multi-node tests
(tests/test_multinode.py, tests/test_multinode_faults.py): the namespace fixture, each node's command,
and starting and waiting for the nodes with a clean launcher environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from netns import netns_refusal, two_hosts
from run_cli import TINY, metrics, stop_process


def host_pair(name: str = "st", subnet: str = "10.77.0"):
    """Body of a module-scoped ``hosts`` fixture: skipped with the reason where namespaces cannot be
    made, a failure under CI=true."""
    refusal = netns_refusal()
    if refusal:
        if os.environ.get("CI") == "true":
            pytest.fail(f"multi-node tests need network namespaces in CI: {refusal}")
        pytest.skip(f"network namespaces unavailable: {refusal}")
    with two_hosts(name, subnet) as pair:
        yield pair


def node_command(
    hosts,
    run_dir: Path,
    port: int,
    nproc: int,
    overrides: tuple[str, ...],
    extra: tuple[str, ...],
    nnodes: str = "2",
):
    """``seektrain train`` for one node, the rendezvous at host A's address."""
    args = [
        sys.executable,
        "-m",
        "seektrain.cli.main",
        "train",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-endpoint",
        f"{hosts[0].addr}:{port}",
        *extra,
        "--set",
        f"run.dir={run_dir}",
    ]
    for item in (*TINY, *overrides):
        args += ["--set", item]
    return args


def run_nodes(
    hosts,
    run_dir: Path,
    port: int,
    *overrides: str,
    nproc: int = 1,
    extra: tuple[str, ...] = (),
    node_env: dict[int, dict] | None = None,
    nodes: tuple[int, ...] = (0, 1),
    timeout: float = 400,
):
    """Start ``seektrain train`` on the given nodes (one shared run dir, as on shared storage) and wait
    for all; returns [(exit code, output)] per node."""
    argvs = {
        k: node_command(hosts, run_dir, port, nproc, overrides, ("--node-rank", str(k), *extra))
        for k in nodes
    }
    return run_on_nodes(hosts, argvs, node_env, timeout)


def start_on_nodes(hosts, argvs: dict[int, list[str]], node_env: dict[int, dict] | None = None):
    """Start ``argvs[k]`` inside host k's namespace, all at once, with a clean launcher environment;
    returns the processes (output on their stdout, stderr merged)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for var in ("LOCAL_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return [
        subprocess.Popen(
            hosts[k].command(argv),
            env={**env, **(node_env or {}).get(k, {})},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for k, argv in argvs.items()
    ]


def wait_all(procs, timeout: float = 400) -> list[tuple[int, str]]:
    """[(exit code, output)] per process; any still running after ``timeout`` is stopped (SIGTERM: the
    agent stops its workers too)."""
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_process(proc)
    return results


def run_on_nodes(
    hosts, argvs: dict[int, list[str]], node_env: dict[int, dict] | None = None, timeout: float = 400
):
    """Run ``argvs[k]`` inside host k's namespace, all at once, and wait for all."""
    return wait_all(start_on_nodes(hosts, argvs, node_env), timeout)


def step_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir)}  # a resumed step's last record counts
