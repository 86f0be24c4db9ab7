"""Start ``seektrain train`` workers through PyTorch's elastic launcher (torch.distributed.run).

One node uses ``--standalone`` (a private c10d rendezvous on a free port). Several nodes use the c10d
rendezvous at ``--rdzv-endpoint``; we tell torchrun what it would otherwise guess from host names
(launch/network.py): whether this node hosts the store, the address to advertise, and the interface
gloo and NCCL bind to. The workers re-run this CLI, so what they execute is exactly the command the
user typed, minus the launcher options. Every way the launch can fail ends in one line.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import sys
from dataclasses import dataclass, field

from seektrain.errors import UserError
from seektrain.exit_codes import EXIT_FAILED, EXIT_OK, signal_exit
from seektrain.launch.network import NodeNetwork, node_network, wait_for_endpoint

RDZV_BACKEND = "seektrain-c10d"  # launch/rendezvous.py: c10d plus a round token for the workers


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: str | None = None  # None: --nnodes not given (one node)
    node_rank: int | None = None
    rdzv_endpoint: str = ""
    rdzv_id: str = "seektrain"
    max_restarts: int = 0
    local_addr: str = ""
    rdzv_timeout_s: float = 300.0  # dist.init_timeout_s unless --rdzv-timeout is given
    socket_ifname: str = ""  # dist.socket_ifname
    worker_env: dict[str, str] = field(default_factory=dict)  # dist.env

    @property
    def node_range(self) -> tuple[int, int]:
        """(min, max) nodes from ``--nnodes N`` or ``MIN:MAX``; a ValueError of one line otherwise."""
        lo, sep, hi = (self.nnodes or "1").partition(":")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UserError(
                f"--nnodes {self.nnodes!r}: give a node count N or an elastic range MIN:MAX, e.g. 2 or 2:4"
            )
        lo_n, hi_n = int(lo), int(hi) if sep else int(lo)
        if lo_n < 1 or hi_n < lo_n:
            raise UserError(f"--nnodes {self.nnodes!r}: need 1 <= MIN <= MAX nodes, e.g. 2 or 2:4")
        return lo_n, hi_n

    @property
    def multi_node(self) -> bool:
        return self.node_range[1] > 1

    def fixed_world_size(self) -> int | None:
        """World size when the node count is fixed (elastic ranges like 2:4 give None)."""
        lo, hi = self.node_range
        return self.nproc_per_node * lo if lo == hi else None

    def validate(self) -> None:
        """Every launcher option on its own, before any process or socket starts."""
        if self.nproc_per_node < 1:
            raise UserError("--nproc-per-node must be >= 1")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts}: must be >= 0 (0 = no restart)")
        if not (math.isfinite(self.rdzv_timeout_s) and self.rdzv_timeout_s > 0):
            raise UserError(f"--rdzv-timeout {self.rdzv_timeout_s:g}: must be > 0 seconds, and finite")
        _, hi = self.node_range
        if self.node_rank is not None and not 0 <= self.node_rank < hi:
            raise UserError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes or 1}: "
                f"use 0..{hi - 1}, a different one on each node"
            )
        if hi > 1 and not self.rdzv_endpoint:
            raise UserError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the first node's address, the same "
                "on every node)"
            )
        if self.nnodes is None and (
            self.rdzv_endpoint or self.local_addr
        ):  # forgotten --nnodes: never train alone
            # (an explicit --nnodes 1, as in a one-node Slurm job, is one node: its endpoint is not needed)
            raise UserError(
                "--rdzv-endpoint/--local-addr are for several nodes; add --nnodes N "
                "(or drop them for a one-node run)"
            )

    @property
    def node_name(self) -> str:
        return f"node {self.node_rank}" if self.node_rank is not None else "this node"


def torchrun_args(opts: LaunchOptions, worker_argv: list[str], net: NodeNetwork | None = None) -> list[str]:
    args = [f"--nproc-per-node={opts.nproc_per_node}", f"--max-restarts={opts.max_restarts}"]
    if net is not None:
        timeout = max(1, round(opts.rdzv_timeout_s))
        conf = f"join_timeout={timeout},read_timeout={timeout}"
        if not net.endpoint_ip.startswith("127."):  # on loopback every node is local: torchrun's own
            conf += f",is_host={int(net.hosts_store)}"  # try-host-then-join is right there
        args += [
            f"--nnodes={opts.nnodes}",
            f"--rdzv-backend={RDZV_BACKEND}",
            f"--rdzv-endpoint={net.endpoint}",
            f"--rdzv-id={opts.rdzv_id}",
            f"--rdzv-conf={conf}",
            f"--local-addr={net.local_addr}",
        ]
    else:
        args.append("--standalone")
    return args + ["-m", "seektrain.cli.main", *worker_argv]


def worker_env(opts: LaunchOptions, net: NodeNetwork | None, environ: dict[str, str]) -> dict[str, str]:
    """Variables the agent exports to its workers: ``dist.env``, the interface (a detected one never
    overrides GLOO_/NCCL_SOCKET_IFNAME the user set), what was detected, for ``env.json``, this node's
    launch options, which the workers compare across nodes, and the agent's pid, which they end with."""
    from seektrain.launch.agent_lifeline import AGENT_PID_VAR
    from seektrain.parallel.dist_env import AUTO_IFNAME_VAR, IFNAME_VARS, LAUNCH_VAR, LOCAL_ADDR_VAR

    env = dict(opts.worker_env)
    env[AGENT_PID_VAR] = str(os.getpid())  # the workers end when this agent does (launch/agent_lifeline.py)
    env[LAUNCH_VAR] = f"--nnodes {opts.nnodes or 1} --nproc-per-node {opts.nproc_per_node}"
    if opts.socket_ifname:
        env.update(dict.fromkeys(IFNAME_VARS, opts.socket_ifname))
    if net is not None:
        env[LOCAL_ADDR_VAR] = net.local_addr
        if net.ifname:
            env[AUTO_IFNAME_VAR] = net.ifname
            env.update({v: net.ifname for v in IFNAME_VARS if v not in environ and v not in env})
    return env


def describe(opts: LaunchOptions, net: NodeNetwork, env: dict[str, str]) -> str:
    role = "hosts the rendezvous store" if net.hosts_store else "joins the rendezvous"
    ifnames = ", ".join(
        f"{v}={env.get(v, os.environ.get(v))}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    )
    return (
        f"seektrain: {opts.node_name} {role} at {net.endpoint}, advertises {net.local_addr}; {ifnames} "
        f"(timeout {opts.rdzv_timeout_s:g} s)"
    )


def launch(opts: LaunchOptions, worker_argv: list[str], what: str = "training") -> int:
    """Run the workers to completion; returns a process exit code (0 = every worker succeeded).
    ``what`` names the workers in the failure line (``training``, ``doctor``). A failed worker's one line is
    printed once, by ``report_failures`` (launch/worker_errors.py)."""
    from seektrain.launch.worker_errors import worker_error_folder

    opts.validate()
    net = node_network(opts.rdzv_endpoint, opts.local_addr, opts.socket_ifname) if opts.multi_node else None
    env = worker_env(opts, net, dict(os.environ))
    if net is not None:
        print(describe(opts, net, env), file=sys.stderr, flush=True)  # the choice, logged once
    os.environ.update(env)  # the agent's environment is what its workers inherit
    problem = _store_problem(opts, net) if net is not None else None
    if problem:
        print(f"seektrain: error: {problem}", file=sys.stderr)
        return EXIT_FAILED
    with worker_error_folder(quiet=opts.max_restarts == 0) as errors:
        return _run(opts, worker_argv, what, net, errors)


def _run(opts: LaunchOptions, worker_argv: list[str], what: str, net: NodeNetwork | None, errors) -> int:
    """torchrun itself; each way it can fail becomes one line (``errors``: the workers' error folder)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from seektrain.launch.worker_errors import preempted_line, report_failures

    try:
        if net is not None:
            from seektrain.launch.rendezvous import register

            register()
        _quiet_rendezvous_logs()
        run(parse_args(torchrun_args(opts, worker_argv, net)))
    except SignalException as err:  # preemption: the workers' own line says what they kept
        print(
            preempted_line(errors)
            or f"seektrain: stopped by signal {err.sigval.name} before the workers said what they saved; "
            "the same command resumes from the newest complete checkpoint in run.dir",
            file=sys.stderr,
        )
        return signal_exit(err.sigval)
    except ChildFailedError as err:
        return report_failures(err.failures, errors, what)
    except RendezvousError as err:
        print(f"seektrain: error: {rendezvous_failure(opts, net, err)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def rendezvous_failure(opts: LaunchOptions, net: NodeNetwork | None, err: Exception) -> str:
    """One line for a rendezvous that did not complete: which endpoint, which node, what to do."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from seektrain.launch.rendezvous import NodeCountMismatch

    where = f"{opts.node_name} ({net.local_addr})" if net else opts.node_name
    endpoint = net.endpoint if net else opts.rdzv_endpoint
    if isinstance(err, NodeCountMismatch):
        return f"{where} at {endpoint}: {err}"
    if isinstance(err, RendezvousClosedError):
        return (
            f"{where}: another node stopped the rendezvous at {endpoint} (its own error line says why, e.g. "
            "a different --nnodes); start every node again with the same options"
        )
    if isinstance(err, RendezvousConnectionError):
        return (
            unreachable(opts, net) if net else f"{where} could not reach the rendezvous store at {endpoint}"
        )
    if isinstance(err, RendezvousTimeoutError):
        lo, _ = opts.node_range
        return (
            f"{where}: not all {lo} nodes joined the rendezvous at {endpoint} within "
            f"{opts.rdzv_timeout_s:g} s; start `seektrain train` with the same --rdzv-endpoint and --nnodes "
            "on every node, or raise --rdzv-timeout"
        )
    return (
        f"{where}: the rendezvous at {endpoint} failed ({type(err).__name__}: {err}); start every node again"
    )


def _store_problem(opts: LaunchOptions, net: NodeNetwork) -> str | None:
    """One line when the rendezvous store cannot be hosted or reached (launch/store_probe.py), else None."""
    from seektrain.launch.store_probe import listening, port_taken, store_answers

    ip, port = net.endpoint_ip, net.endpoint.port
    loopback = ipaddress.ip_address(ip).is_loopback  # every node is local: the first to come hosts it
    if net.hosts_store and not loopback:
        if port_taken(ip, port):
            return (
                f"{opts.node_name} is to host the rendezvous store at {net.endpoint}, but another program "
                f"already listens on port {port}; pick a free port for --rdzv-endpoint on every node"
            )
        return None
    if not loopback and not wait_for_endpoint(ip, port, opts.rdzv_timeout_s):
        return unreachable(opts, net)
    if (not loopback or listening(ip, port)) and not store_answers(ip, port, opts.rdzv_timeout_s):
        return (
            f"{opts.node_name}: what listens at {net.endpoint} did not answer as a rendezvous store within "
            f"{opts.rdzv_timeout_s:g} s; another program holds that port: pick a free port for "
            "--rdzv-endpoint on every node"
        )
    return None


def unreachable(opts: LaunchOptions, net: NodeNetwork) -> str:
    return (
        f"{opts.node_name} ({net.local_addr}) could not reach the rendezvous store at {net.endpoint} within "
        f"{opts.rdzv_timeout_s:g} s; start node 0 (the host of {net.endpoint_ip}) too, check the address, "
        "port and firewall, or raise --rdzv-timeout"
    )


def _quiet_rendezvous_logs() -> None:
    """torchrun logs a failed rendezvous (and a peer lost at the exit barrier) with a multi-line
    traceback before raising; we print one line instead. The rendezvous modules are silenced; the agent
    keeps its warnings (a worker failed, the group restarts) but loses the tracebacks."""
    for name in (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    if not any(isinstance(f, _NoTracebacks) for f in agent.filters):
        agent.addFilter(_NoTracebacks())


class _NoTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None
