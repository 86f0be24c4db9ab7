"""`seektrain train`: run the training job here, or launch workers for it through torchrun."""

from __future__ import annotations

import argparse
import os
import sys

from seektrain.cli.arg_types import float_in, int_in
from seektrain.cli.config_args import add_config_args, config_argv
from seektrain.exit_codes import EXIT_OK
from seektrain.launch.elastic import LaunchOptions, launch
from seektrain.launch.preflight import check_layout


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (the built-in default when no --config is given)",
        epilog="every config key with its type, default and help: seektrain config keys",
    )
    add_config_args(p, "TOML config file (default: the built-in tiny-v3 run)")
    p.add_argument(
        "--deepspeed",
        metavar="DS_CONFIG.json",
        help="a DeepSpeed config applied over --config, under --set (seektrain config from-deepspeed)",
    )
    p.add_argument("--nproc-per-node", type=int_in(1), default=1, help="worker processes on this node")
    p.add_argument("--nnodes", default=None, help="number of nodes, or MIN:MAX for elastic (default 1)")
    p.add_argument(
        "--node-rank", type=int_in(0), default=None, help="this node's rank, 0..N-1 (optional with c10d)"
    )
    p.add_argument(
        "--rdzv-endpoint",
        default="",
        help="HOST:PORT of the c10d rendezvous, the same on every node: an address of the first node",
    )
    p.add_argument("--rdzv-id", default="seektrain")
    p.add_argument(
        "--local-addr",
        default="",
        help="address this node advertises to the others (default: the one its route to the endpoint uses)",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float_in(above=0),
        default=None,
        metavar="SECONDS",
        help="end the launch when not every node joined within this (default: dist.init_timeout_s)",
    )
    p.add_argument("--max-restarts", type=int_in(0), default=0, help="restart failed workers up to K times")
    p.set_defaults(handler=run)


def worker_argv(args: argparse.Namespace) -> list[str]:
    return ["train", *config_argv(args)]


def run(args: argparse.Namespace) -> int:
    from seektrain.config.loader import load_config

    if args.deepspeed:  # the file becomes --set items ahead of the user's; workers get those, not the file
        from seektrain.cli.config_cmd import deepspeed_overrides

        args.overrides = deepspeed_overrides(args)
    cfg = load_config(args.config, args.overrides)  # fail fast, before any process starts
    from seektrain.config.loader import dist_env_vars

    opts = LaunchOptions(
        args.nproc_per_node,
        args.nnodes,
        args.node_rank,
        args.rdzv_endpoint,
        args.rdzv_id,
        args.max_restarts,
        args.local_addr,
        args.rdzv_timeout if args.rdzv_timeout is not None else cfg.dist.init_timeout_s,
        cfg.dist.socket_ifname,
        dist_env_vars(cfg.dist.env),
    )
    opts.validate()
    under_launcher = "LOCAL_RANK" in os.environ
    if not under_launcher and (opts.nproc_per_node > 1 or opts.multi_node or opts.max_restarts > 0):
        world = opts.fixed_world_size()
        if world is not None:
            check_layout(cfg, world, opts.nproc_per_node)
        return launch(opts, worker_argv(args))
    if not under_launcher:
        check_layout(cfg, 1)
    else:
        from seektrain.launch.agent_lifeline import end_with_agent

        end_with_agent()  # a worker whose agent is killed must not train on alone
    from seektrain.cli.error_lines import report_preempted
    from seektrain.train.preemption import Preempted
    from seektrain.train.trainer import train

    try:
        train(cfg, report_line=report_preempted)  # the grace watchdog's line, the CLI's one-line way
    except Preempted as stop:  # SIGTERM: exit 143 with the line saying what run.dir holds
        sys.stdout.flush()
        return report_preempted(stop.line, stop.code)
    sys.stdout.flush()
    return EXIT_OK
