"""Multi-node training on one machine: two network namespaces joined by a veth pair (tests/netns.py)
are two hosts that reach each other only by IP, as in issue 12 (tests/two_nodes.py runs the nodes). Each
node runs the real CLI,
``seektrain train --nnodes 2 --rdzv-endpoint 10.77.0.1:PORT``, with nothing else set: the launcher finds
the store host, the address to advertise and the interface by itself.

Checked: per-step losses equal one node with the same world size (FSDP, TP across the nodes, and
2 x 2 processes with the pipeline split across the nodes); ``kill -9`` of node 1's worker with
``--max-restarts 1`` resumes both nodes from the last checkpoint and ends at the uninterrupted loss; a
missing node and an unreachable endpoint end within the timeout with one line; ``seektrain doctor --comm``
measures the link between the nodes. Needs root for
``ip netns``; skipped with the reason elsewhere, except under CI=true where a skip is a failure.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from fault_injection import hooks_env
from run_cli import train
from two_nodes import host_pair, node_command, run_nodes, run_on_nodes, step_losses

ENDPOINT = "10.77.0.1"


@pytest.fixture(scope="module")
def hosts():
    yield from host_pair("st", "10.77.0")


_references: dict[tuple, dict[int, float]] = {}


def one_node_losses(tmp_dir: Path, world: int, overrides: tuple[str, ...]) -> dict[int, float]:
    key = (world, overrides)
    if key not in _references:
        run = tmp_dir / f"one-node-{len(_references)}"
        train(run, *overrides, nproc=world, timeout=400)
        _references[key] = step_losses(run)
    return _references[key]


FSDP_6 = ("train.steps=6", "checkpoint.interval=2")  # shared by the loss test and the restart test


@pytest.mark.parametrize(
    "nproc,overrides,port",
    [
        (1, FSDP_6, 29401),
        (1, ("train.steps=3", "parallel.tp=2"), 29402),  # TP across the two nodes
        # pipeline stages on different nodes, FSDP inside each
        (2, ("train.steps=3", "parallel.pp=2", "parallel.pp_microbatches=2"), 29403),
    ],
    ids=["fsdp-2x1", "tp-2x1", "pp-fsdp-2x2"],
)
def test_two_nodes_train_like_one_node(hosts, tmp_path_factory, nproc, overrides, port):
    run = tmp_path_factory.mktemp("multinode")
    results = run_nodes(hosts, run, port, *overrides, nproc=nproc)
    for rc, out in results:
        assert rc == 0, out[-4000:]
    assert "node 0 hosts the rendezvous store at 10.77.0.1" in results[0][1]
    assert f"node 1 joins the rendezvous at 10.77.0.1:{port}, advertises 10.77.0.2" in results[1][1]
    got = step_losses(run)
    want = one_node_losses(tmp_path_factory.mktemp("reference"), 2 * nproc, overrides)
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-6, (step, got[step], loss)
    env = json.loads((run / "env.json").read_text())
    assert {r["addr"] for r in env["ranks"]} == {"10.77.0.1", "10.77.0.2"}
    assert env["backend"] == "gloo" and env["versions"]["torch"]
    assert {r["ifname"]["GLOO_SOCKET_IFNAME"] for r in env["ranks"]} == {hosts[0].ifname, hosts[1].ifname}


def test_killed_worker_on_node_1_resumes_both_nodes(hosts, tmp_path_factory):
    run = tmp_path_factory.mktemp("restart")
    results = run_nodes(
        hosts,
        run,
        29480,
        *FSDP_6,
        extra=("--max-restarts", "1"),
        node_env={1: hooks_env({"SEEKTRAIN_TEST_KILL": "4"})},
    )  # node 1's worker SIGKILLs itself
    for rc, out in results:
        assert rc == 0, out[-4000:]
    assert "exitcode: -9" in results[1][1]
    assert "resumed from" in results[0][1] and "step-00000002 at step 2" in results[0][1]
    want = one_node_losses(tmp_path_factory.mktemp("reference"), 2, FSDP_6)
    got = step_losses(run)
    assert sorted(got) == sorted(want)
    assert abs(got[6] - want[6]) <= 1e-6 and all(abs(got[s] - want[s]) <= 1e-6 for s in want)


def test_missing_node_and_unreachable_endpoint_end_with_one_line(hosts, tmp_path_factory):
    """Node 0 waits for a node 1 that never comes; a node 1 whose endpoint nobody hosts cannot connect.
    Both end within the timeout with one line naming the endpoint, the node and the fix."""
    run = tmp_path_factory.mktemp("missing")
    t0 = time.monotonic()
    waiting = run_nodes(
        hosts, run, 29490, "train.steps=2", extra=("--rdzv-timeout", "6"), nodes=(0,), timeout=120
    )
    lonely = run_nodes(
        hosts, run, 29491, "train.steps=2", extra=("--rdzv-timeout", "6"), nodes=(1,), timeout=120
    )
    assert time.monotonic() - t0 < 120
    for (rc, out), expected in (
        (
            waiting[0],
            "node 0 (10.77.0.1): not all 2 nodes joined the rendezvous at 10.77.0.1:29490 within 6 s",
        ),
        (lonely[0], "node 1 (10.77.0.2) could not reach the rendezvous store at 10.77.0.1:29491 within 6 s"),
    ):
        assert rc == 1, out
        errors = [line for line in out.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith(f"seektrain: error: {expected}"), out
        assert "Traceback" not in out and "--rdzv-timeout" in errors[0]


def test_doctor_comm_measures_the_link_between_the_nodes(hosts, tmp_path_factory):
    """`seektrain doctor --comm` across the two hosts: the bandwidth table on 2 ranks, the one link named
    by both nodes' advertised addresses, and the run dir seen by both (it is shared here)."""
    run = tmp_path_factory.mktemp("doctor")
    argvs = {
        k: [
            sys.executable,
            "-m",
            "seektrain.cli.main",
            "doctor",
            "--comm",
            "--sizes",
            "4K,64K",
            "--iters",
            "2",
            "--write-mib",
            "4",
            "--run-dir",
            str(run),
            "--json",
            "--nnodes",
            "2",
            "--node-rank",
            str(k),
            "--rdzv-endpoint",
            f"{ENDPOINT}:29470",
        ]
        for k in (0, 1)
    }
    (rc0, out0), (rc1, out1) = run_on_nodes(hosts, argvs, timeout=300)
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    lines = out0.splitlines()  # the agent's log lines are mixed in: the report is from "{" to "}"
    report = json.loads("\n".join(lines[lines.index("{") : len(lines) - lines[::-1].index("}")]))
    comm = report["comm"]
    assert comm["world_size"] == 2 and comm["backend"] == "gloo"
    assert sorted({row["op"] for row in comm["rows"]}) == [
        "all_gather",
        "all_reduce",
        "all_to_all",
        "reduce_scatter",
    ]
    assert all(row["algbw_gbps"] > 0 for row in comm["rows"])
    [link] = comm["links"]
    assert link["src_host"].endswith("(10.77.0.1)") and link["dst_host"].endswith("(10.77.0.2)")
    storage = {c["name"]: c for c in report["checks"]}["shared storage"]
    assert storage["status"] == "ok" and "all 2 ranks on 2 host(s)" in storage["detail"]


@pytest.mark.parametrize(
    "node1_extra,port,expected",
    [
        # node 1 asks for 2 processes: the rendezvous completes, the workers compare launch options at start-up
        (
            ("--nproc-per-node", "2"),
            29460,
            [
                "nodes were started with different launch options: vm (10.77.0.1) (rank 0) "
                "with --nnodes 2 --nproc-per-node 1, vm (10.77.0.2) was started with "
                "--nnodes 2 --nproc-per-node 2"
            ]
            * 2,
        ),
        # node 1 asks for 3 nodes: it stops at the store, and node 0's rendezvous is closed
        (
            ("--nnodes", "3"),
            29461,
            [
                "node 0 (10.77.0.1): another node stopped the rendezvous at 10.77.0.1:29461",
                "node 1 (10.77.0.2) at 10.77.0.1:29461: this node was started with --nnodes 3 but "
                "the nodes already at the rendezvous with --nnodes 2",
            ],
        ),
    ],
    ids=["nproc", "nnodes"],
)
def test_nodes_with_different_launch_options_end_with_one_line(
    hosts, tmp_path_factory, node1_extra, port, expected
):
    """Nodes started with different --nproc-per-node or --nnodes stop within seconds, each with one line
    naming the mismatch, before anything trains (a batch valid for every world size they could form)."""
    run = tmp_path_factory.mktemp("mismatch")
    steps = ("train.steps=2", "train.global_batch_size=24")  # divides 2 x 2, 2 x 3 and 2 x 4
    argvs = {
        k: node_command(
            hosts,
            run,
            port,
            1,
            steps,
            ("--node-rank", str(k), "--rdzv-timeout", "120", *(node1_extra if k else ())),
        )
        for k in (0, 1)
    }
    t0 = time.monotonic()
    results = run_on_nodes(hosts, argvs, timeout=300)
    assert time.monotonic() - t0 < 90  # well inside the rendezvous timeout
    for (rc, out), want in zip(results, expected):
        assert rc != 0 and "Traceback" not in out, out[-3000:]
        errors = [line for line in out.splitlines() if line.startswith("seektrain: error:")]
        assert len(errors) == 1 and errors[0].startswith(f"seektrain: error: {want}"), out[-3000:]
    assert not (run / "metrics.jsonl").exists()


# -- the same decisions without namespaces (fast) ------------------------------------------------------
from seektrain.config.loader import ConfigError, load_config  # noqa: E402
from seektrain.launch.elastic import LaunchOptions, torchrun_args, worker_env  # noqa: E402
from seektrain.launch.network import node_network, parse_endpoint  # noqa: E402
from seektrain.parallel.dist_env import mismatched_launch, mismatched_versions, worker_environment  # noqa: E402


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(nnodes="0"), "--nnodes '0': need 1 <= MIN <= MAX"),
        (dict(nnodes="2:1"), "--nnodes '2:1': need 1 <= MIN <= MAX"),
        (dict(nnodes="two"), "--nnodes 'two': give a node count N"),
        (
            dict(nnodes="2", node_rank=2, rdzv_endpoint="10.0.0.1:1"),
            "--node-rank 2 is out of range for --nnodes 2",
        ),
        (dict(nnodes="2"), "--nnodes > 1 needs --rdzv-endpoint"),
        (dict(max_restarts=-1), "--max-restarts -1: must be >= 0"),
        (dict(rdzv_timeout_s=0), "--rdzv-timeout 0: must be > 0"),
    ],
)
def test_bad_launch_options_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        LaunchOptions(**kwargs).validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_bad_endpoints_are_one_line():
    for text in ("node0", "node0:", ":29500", "node0:http", "node0:70000"):
        with pytest.raises(ValueError, match=r"is not HOST:PORT"):
            parse_endpoint(text)
    assert parse_endpoint("[fd00::1]:29500").host == "fd00::1"
    with pytest.raises(ValueError, match=r"host 'no-such-node\.invalid' does not resolve on this node"):
        node_network("no-such-node.invalid:29500")
    import socket

    if socket.gethostbyname(socket.gethostname()).startswith("127."):  # Debian's /etc/hosts default
        with pytest.raises(ValueError, match=r"resolves to 127\.[0-9.]+ \(loopback\) on this node"):
            node_network(f"{socket.gethostname()}:29500")
    with pytest.raises(ValueError, match=r"--local-addr 10\.77\.9\.9 is not an address of this node"):
        node_network("127.0.0.1:29500", local_addr="10.77.9.9")


def test_cli_refuses_bad_node_count_before_training(tmp_path):
    from run_cli import seektrain

    proc = seektrain("train", "--nnodes", "2:1", "--set", f"run.dir={tmp_path}", check=False, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "seektrain: error: --nnodes '2:1': need 1 <= MIN <= MAX nodes, e.g. 2 or 2:4"
    )
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_endpoint_needs_an_explicit_node_count():
    """A forgotten --nnodes must not train alone; an explicit --nnodes 1 (a one-node Slurm job) is one node,
    which needs no rendezvous endpoint."""
    with pytest.raises(
        ValueError, match=r"--rdzv-endpoint/--local-addr are for several nodes; add --nnodes N"
    ):
        LaunchOptions(rdzv_endpoint="127.0.0.1:29500").validate()
    one = LaunchOptions(nnodes="1", rdzv_endpoint="127.0.0.1:29500")
    one.validate()
    assert not one.multi_node


def test_loopback_endpoint_is_hosted_here_and_torchrun_gets_address_and_timeouts():
    net = node_network("127.0.0.1:29500")
    assert net.hosts_store and net.local_addr == "127.0.0.1" and net.ifname == "lo"
    opts = LaunchOptions(nproc_per_node=2, nnodes="2", rdzv_endpoint="127.0.0.1:29500", rdzv_timeout_s=30)
    args = torchrun_args(opts, ["train"], net)
    assert "--local-addr=127.0.0.1" in args and "--rdzv-backend=seektrain-c10d" in args
    assert "--rdzv-conf=join_timeout=30,read_timeout=30" in args  # loopback: torchrun may host or join


def test_interface_choice_respects_the_user():
    from seektrain.config.schema import DistSection

    auto = DistSection()
    assert worker_environment(auto, {}, "eth1") == {
        "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_SOCKET_IFNAME": "eth1",
    }
    assert worker_environment(auto, {"NCCL_SOCKET_IFNAME": "ib0"}, "eth1") == {"GLOO_SOCKET_IFNAME": "eth1"}
    forced = DistSection(socket_ifname="ib0", env=["NCCL_DEBUG=WARN", "NCCL_IB_HCA=mlx5_0,mlx5_1"])
    assert worker_environment(forced, {"GLOO_SOCKET_IFNAME": "eth0"}, "eth1") == {
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_DEBUG": "WARN",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
    }
    net = node_network("127.0.0.1:29500")
    env = worker_env(
        LaunchOptions(nnodes="2", rdzv_endpoint="127.0.0.1:29500"), net, {"GLOO_SOCKET_IFNAME": "x"}
    )
    assert env["SEEKTRAIN_LOCAL_ADDR"] == "127.0.0.1" and "GLOO_SOCKET_IFNAME" not in env
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["SEEKTRAIN_LAUNCH"] == "--nnodes 2 --nproc-per-node 1"


def test_dist_section_keys():
    cfg = load_config(
        None, ["dist.backend=gloo", "dist.env=[NCCL_DEBUG=INFO, TORCH_NCCL_ASYNC_ERROR_HANDLING=1]"]
    )
    assert cfg.dist.env == ["NCCL_DEBUG=INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]
    for bad, message in (
        ("dist.backend=mpi", "dist.backend='mpi': use one of auto, nccl, gloo"),
        ("dist.env=NCCL_DEBUG", "dist.env: 'NCCL_DEBUG' is not NAME=VALUE"),
        ("dist.init_timeout_s=0", "dist.init_timeout_s=0.0: must be > 0"),
        (
            "train.collective_timeout_s=5",
            "config key 'train.collective_timeout_s' moved to 'dist.collective_timeout_s'",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [bad])
        assert str(err.value).startswith(message)


def test_mixed_versions_are_named():
    def facts(host, torch_version):
        return {"host": host, "versions": {"seektrain": "0.1.0", "torch": torch_version}}

    assert mismatched_versions([facts("a", "2.13.0"), facts("b", "2.13.0")]) is None
    assert mismatched_versions([facts("a", "2.13.0"), facts("b", "2.12.1")]) == (
        "mixed torch versions across nodes: rank 0 on a has 2.13.0, rank 1 on b has 2.12.1; install the same "
        "torch on every node"
    )


def test_mixed_launch_options_are_named():
    def facts(addr, launch):
        return {"host": "vm", "addr": addr, "launch": launch}

    same = "--nnodes 2 --nproc-per-node 1"
    assert mismatched_launch([facts("10.0.0.1", same), facts("10.0.0.2", same)]) is None
    assert mismatched_launch(
        [facts("10.0.0.1", same), facts("10.0.0.2", "--nnodes 3 --nproc-per-node 1")]
    ) == (
        "nodes were started with different launch options: vm (10.0.0.1) (rank 0) with --nnodes 2 "
        "--nproc-per-node 1, vm (10.0.0.2) was started with --nnodes 3 --nproc-per-node 1; start every "
        "node with the same --nnodes and --nproc-per-node"
    )
