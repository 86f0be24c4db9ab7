"""Node and link faults across two "hosts" (network namespaces joined by a veth pair, tests/netns.py),
each node running the real ``seektrain train`` (tests/two_nodes.py):

* the veth link taken down mid-run, after a checkpoint: both nodes stop, each with one line naming the
  peer (rank and address) and the operation, within the collective timeout plus the agents' exit; with
  the link up again the same command resumes from the last checkpoint and gives the uninterrupted
  losses exactly;
* run.dir a local folder on each node (node 1's mount namespace binds its own folder at the path):
  refused on both nodes before step 1, with one line;
* (slow, ~2-3 min) under ``--nnodes 1:2 --max-restarts 1``, node 1's agent killed with SIGKILL: its worker
  dies with it (launch/agent_lifeline.py), node 0's worker fails with one line naming node 1, its agent
  re-forms the group with one node, says so, and resumes from the last checkpoint resharded to world 1.

Own namespace names and subnet (``nf``, 10.78.0.0/24), so these run in any order with test_multinode.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from run_cli import train
from two_nodes import host_pair, node_command, start_on_nodes, step_losses, wait_all

COLLECTIVE_TIMEOUT_S = 4
EXIT_SLACK_S = 40  # the worker's exit and the agents' (bounded) goodbyes to the store, on a busy 2-core box
LINK_RUN = ("train.steps=16", "checkpoint.interval=4", f"dist.collective_timeout_s={COLLECTIVE_TIMEOUT_S}")


@pytest.fixture(scope="module")
def hosts():
    yield from host_pair("nf", "10.78.0")


def wait_for(path: Path, procs, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        assert all(p.poll() is None for p in procs), "a node ended before the fault was injected"
        time.sleep(0.1)


def end_times(procs, timeout: float) -> list[float]:
    """When each process ended (monotonic), polling; output stays in its pipe (a few KiB)."""
    ends: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout
    while None in ends and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if ends[i] is None and proc.poll() is not None:
                ends[i] = time.monotonic()
        time.sleep(0.1)
    return [e if e is not None else float("inf") for e in ends]


def error_lines(out: str) -> list[str]:
    """Our lines (torch's C++ store client logs its retries with stack frames: not ours to count)."""
    return [line for line in out.splitlines() if line.startswith("seektrain: error")]


def link(host, state: str) -> None:
    subprocess.run(["ip", "-n", host.netns, "link", "set", host.ifname, state], check=True, timeout=30)


@pytest.mark.slow  # 141-310 s measured on the shared 2-core box (three 2-node launches and a reference)
def test_link_down_stops_both_nodes_with_one_line_and_the_rerun_resumes_exactly(hosts, tmp_path_factory):
    run = tmp_path_factory.mktemp("link")
    argvs = {
        k: node_command(hosts, run, 29811, 1, LINK_RUN, ("--node-rank", str(k), "--rdzv-timeout", "30"))
        for k in (0, 1)
    }
    procs = start_on_nodes(hosts, argvs)
    try:
        wait_for(run / "checkpoints" / "step-00000004", procs)
        link(hosts[0], "down")
        down = time.monotonic()
        ends = end_times(procs, COLLECTIVE_TIMEOUT_S + EXIT_SLACK_S + 30)
    finally:
        results = wait_all(procs, timeout=60)
        link(hosts[0], "up")
    last = max(  # the last committed checkpoint (a save the fault cut short is a .tmp)
        p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-") and "." not in p.name
    )
    for k, ((rc, out), end) in enumerate(zip(results, ends)):
        peer = hosts[1 - k]
        assert end - down < COLLECTIVE_TIMEOUT_S + EXIT_SLACK_S, (k, end - down, out[-3000:])
        assert rc == 2 and "Traceback" not in out, out[-3000:]
        [line] = error_lines(out)
        assert line.startswith(f"seektrain: error: rank {k} on ") and f"({hosts[k].addr}): " in line, line
        assert "a collective failed during step" in line, line  # the operation
        assert f"It waits on rank {1 - k} on " in line and f"({peer.addr})" in line, line  # the peer
        assert f"Timed out waiting {COLLECTIVE_TIMEOUT_S * 1000}ms" in line, line  # the timeout applied
        assert f"dist.collective_timeout_s (now {COLLECTIVE_TIMEOUT_S} s)" in line, line
    # the link is back: the same command resumes from the last checkpoint and ends as if nothing happened
    rerun = wait_all(start_on_nodes(hosts, argvs), timeout=400)
    for rc, out in rerun:
        assert rc == 0, out[-3000:]
    assert f"resumed from {run / 'checkpoints' / last} at step {int(last.split('-')[1])}" in rerun[0][1]
    reference = tmp_path_factory.mktemp("link-reference")
    train(reference, *LINK_RUN, nproc=2, timeout=400)
    want, got = step_losses(reference), step_losses(run)
    assert sorted(got) == sorted(want) == list(range(1, 17))
    assert all(abs(got[s] - want[s]) <= 1e-6 for s in want), (got, want)


def test_unshared_run_dir_is_refused_on_both_nodes_before_step_1(hosts, tmp_path_factory):
    """Each node has its own local folder at the run.dir path (node 1 binds one over it in its mount
    namespace), as in the original report, where both nodes trained and failed at the first checkpoint."""
    run = tmp_path_factory.mktemp("unshared")
    local = tmp_path_factory.mktemp("node1-local-disk")
    steps = ("train.steps=2", "checkpoint.interval=2")
    argvs = {
        k: node_command(hosts, run, 29821, 1, steps, ("--node-rank", str(k), "--rdzv-timeout", "30"))
        for k in (0, 1)
    }
    argvs[1] = [
        "sh",
        "-c",
        'mount --bind "$1" "$2" && shift 2 && exec "$@"',
        "sh",
        str(local),
        str(run),
        *argvs[1],
    ]
    results = wait_all(start_on_nodes(hosts, argvs), timeout=300)
    for rc, out in results:
        assert rc == 2 and "Traceback" not in out, out[-3000:]
        [line] = error_lines(out)
        assert line.startswith(f"seektrain: error: run.dir={run} is not shared: rank 1 on node "), line
        assert "cannot see the marker file rank 0" in line and "storage every node mounts" in line, line
        assert "step 1/" not in out, out[-3000:]  # refused before the first step
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert not list(local.iterdir())  # node 1 trained nothing into its own folder either


def _agents_workers(agent_pid: int) -> list[int]:
    """Processes started by the agent ``agent_pid`` (they carry its pid in SEEKTRAIN_AGENT_PID)."""
    mark = f"SEEKTRAIN_AGENT_PID={agent_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow  # ~2-3 min: the rendezvous waits out the lost node's heartbeats and torchrun's last call
def test_lost_agent_under_elastic_nodes_reforms_with_one_node_and_resumes(hosts, tmp_path_factory):
    run = tmp_path_factory.mktemp("elastic")
    overrides = (
        "train.steps=16",
        "checkpoint.interval=4",
        f"dist.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
    )
    argvs = {
        k: node_command(
            hosts,
            run,
            29831,
            1,
            overrides,
            ("--node-rank", str(k), "--rdzv-timeout", "60", "--max-restarts", "1"),
            nnodes="1:2",
        )
        for k in (0, 1)
    }
    procs = start_on_nodes(hosts, argvs)
    try:
        wait_for(run / "checkpoints" / "step-00000004", procs)
        agent = procs[1].pid  # `ip netns exec` execs the command: this is node 1's agent
        assert _agents_workers(agent), "node 1's worker not found"
        os.kill(agent, signal.SIGKILL)
        deadline = time.monotonic() + 5  # at once: an orphan could even finish the run in 20 s
        while _agents_workers(agent) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = _agents_workers(agent)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert not orphans, "node 1's worker outlived its agent"
        results = wait_all(procs, timeout=400)
    finally:
        wait_all(procs, timeout=30)
    (rc0, out0), (rc1, _) = results
    assert rc1 == -signal.SIGKILL
    assert rc0 == 0 and "Traceback" not in out0, out0[-4000:]
    [line] = error_lines(out0)  # the first attempt's workers' line; the second attempt ends well
    assert line.startswith("seektrain: error: rank 0 on ") and "It waits on rank 1 on " in line, line
    assert f"({hosts[1].addr})" in line, line
    assert "seektrain: the group re-formed with 1 node (was 2)" in out0, out0[-4000:]
    assert "resumed from" in out0 and "layout world=1 " in out0, out0[-4000:]
    assert sorted(step_losses(run)) == list(range(1, 17))  # every step, the last ones on one node
    resumed = int(out0.split(f"resumed from {run / 'checkpoints'}/step-")[1][:8])
    assert resumed >= 4 and f"at step {resumed}" in out0


# -- the same decisions without namespaces (fast) ------------------------------------------------------
from seektrain.launch.rendezvous import BoundedCall, RoundTokenRendezvous  # noqa: E402
from seektrain.train.collective_failure import CollectiveError, peers_text  # noqa: E402
from seektrain.train.readable_failure import FailedAt, readable_failure  # noqa: E402


def test_peers_are_named_by_node_and_address():
    def facts(*nodes):
        return [{"host": h, "addr": a} for h, a in nodes]

    two = facts(("vm", "10.0.0.1"), ("vm", "10.0.0.2"))
    assert peers_text(two, 0) == "rank 1 on vm (10.0.0.2)"
    four = facts(("a", "10.0.0.1"), ("a", "10.0.0.1"), ("b", "10.0.0.2"), ("b", "10.0.0.2"))
    assert peers_text(four, 1) == "ranks 2-3 on b (10.0.0.2), rank 0 on this node"
    many = facts(*[(f"n{i}", f"10.0.0.{i}") for i in range(6)])
    assert (
        peers_text(many, 0)
        == "rank 1 on n1 (10.0.0.1), rank 2 on n2 (10.0.0.2), rank 3 on n3 (10.0.0.3), 2 more nodes"
    )
    assert peers_text([], 0) == "the other ranks"  # one process: nothing known


def test_collective_error_names_this_node_and_the_peer():
    facts = [{"host": "a", "addr": "10.0.0.1"}, {"host": "b", "addr": "10.0.0.2"}]
    at = FailedAt(1, 3, "step 3 (its collectives)", facts, timeout_s=4.0)
    got = readable_failure(torch.distributed.DistNetworkError("Connection closed by peer"), None, at)
    assert isinstance(got, CollectiveError)
    assert str(got).startswith("rank 1 on b (10.0.0.2): a collective failed during step 3")
    assert "It waits on rank 0 on a (10.0.0.1)" in str(got)


def test_the_agents_store_calls_are_bounded(monkeypatch):
    """A store that does not answer (its node's link is down) holds the agent's check for waiting nodes
    and its close of the rendezvous for seconds, not for the store's read timeout."""
    import threading

    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from seektrain.launch import rendezvous

    monkeypatch.setattr(rendezvous, "MONITOR_WAIT_S", 0.3)
    monkeypatch.setattr(rendezvous, "CLOSE_WAIT_S", 0.3)
    release = threading.Event()

    class StuckInner:
        def num_nodes_waiting(self):
            release.wait(60)
            return 1

        def shutdown(self):
            release.wait(60)
            return True

    handler = RoundTokenRendezvous(StuckInner())
    t0 = time.monotonic()
    assert handler.num_nodes_waiting() == 0 and handler.num_nodes_waiting() == 0  # one call in flight
    assert handler.shutdown() is False
    assert time.monotonic() - t0 < 3
    release.set()
    time.sleep(0.2)
    assert handler.num_nodes_waiting() == 1  # the in-flight answer is not lost

    def fails():
        raise RendezvousConnectionError("store gone")

    with pytest.raises(RendezvousConnectionError, match="store gone"):
        BoundedCall().result(fails, 1.0, 0)
    handler._inner.num_nodes_waiting = fails  # a store that refuses: nobody waits, the agent watches on
    assert handler.num_nodes_waiting() == 0
