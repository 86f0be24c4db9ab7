"""`seektrain doctor`: check this machine (and, launched on several ranks, the job's network and
storage) before a training job does; exit status 1 when anything is a blocker."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from seektrain.cli.arg_types import float_in, int_in
from seektrain.cli.config_args import add_config_args, config_argv
from seektrain.errors import UserError
from seektrain.exit_codes import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check versions, GPUs, network, environment, ports and run.dir "
        "(exit 1 on a blocker); --comm measures collective bandwidth",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_config_args(p, "TOML config whose run.dir (and model, for checkpoint sizes) to check")
    p.add_argument("--run-dir", help="the run folder to check (default: the config's run.dir)")
    p.add_argument(
        "--ports",
        help="ports that must be free: PORT or LOW-HIGH (default: check 29500, "
        "or MASTER_PORT, and only warn)",
    )
    p.add_argument(
        "--min-free-gib", type=float_in(0), default=1.0, help="less free disk under run.dir is a blocker"
    )
    p.add_argument("--write-mib", type=int, default=64, help="MiB written and fsynced to time run.dir")
    p.add_argument(
        "--comm",
        action="store_true",
        help="measure all_reduce, all_gather, reduce_scatter and "
        "all_to_all bandwidth (needs 2 or more ranks)",
    )
    p.add_argument("--sizes", default="", help="--comm message sizes, e.g. 1M,16M,128M (the default)")
    p.add_argument("--iters", type=int, default=5, help="--comm timed calls per size")
    p.add_argument(
        "--timeout-s", type=float_in(above=0), default=300.0, help="collective timeout of the checks"
    )
    p.add_argument("--nproc-per-node", type=int_in(1), default=1, help="worker processes on this node")
    p.add_argument("--nnodes", default="1", help="number of nodes (run the same command on each)")
    p.add_argument("--node-rank", type=int_in(0), default=None, help="this node's rank, 0..N-1")
    p.add_argument(
        "--rdzv-timeout",
        type=float_in(above=0),
        default=300.0,
        metavar="SECONDS",
        help="end the launch when not every node joined within this (default 300)",
    )
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="seektrain-doctor")
    p.set_defaults(handler=run)


def _options(args: argparse.Namespace):
    from seektrain.config.loader import load_config
    from seektrain.doctor.comm import parse_sizes
    from seektrain.doctor.network_checks import parse_ports
    from seektrain.doctor.run import DoctorOptions

    cfg = load_config(args.config, args.overrides)
    if args.write_mib < 1 or args.iters < 1:
        raise UserError("--write-mib and --iters must be >= 1")
    return DoctorOptions(
        run_dir=Path(args.run_dir or cfg.run.dir),
        min_free_gib=args.min_free_gib,
        write_mib=args.write_mib,
        ports=parse_ports(args.ports) if args.ports else None,
        comm=args.comm,
        sizes=tuple(parse_sizes(args.sizes)) if args.sizes else (),
        iters=args.iters,
        multi_node=args.nnodes != "1",
        checkpoint_bytes=_checkpoint_bytes(cfg),
        hf_folder=_hf_folder(cfg.model.hf_path),
    )


def _hf_folder(hf_path: str) -> Path | None:
    """model.hf_path's local folder (a hub id resolved in the cache), whose read rate the doctor measures;
    one that is not there is the start-up's error to give, not the doctor's."""
    if not hf_path:
        return None
    from seektrain.models.hub import resolve_local_path

    try:
        return Path(resolve_local_path(hf_path, "model.hf_path"))
    except ValueError:
        return None


def _checkpoint_bytes(cfg) -> int | None:
    """fp32 weights and two AdamW moments (12 bytes per parameter), for checkpoint.keep + 1 checkpoints."""
    try:
        from seektrain.models.job_model import configured_model_config
        from seektrain.models.param_count import count_params

        counts = count_params(configured_model_config(cfg))
    except (OSError, ValueError):  # a Hugging Face folder that is not there: the disk check still runs
        return None
    return 12 * (counts.total + counts.mtp) * (cfg.checkpoint.keep + 1)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The same check for the workers, without the launch options (torchrun has them)."""
    argv = ["doctor"] + (["--json"] if args.json else []) + (["--comm"] if args.comm else [])
    argv += config_argv(args)
    for flag, value in (("--run-dir", args.run_dir), ("--ports", args.ports), ("--sizes", args.sizes)):
        if value:
            argv += [flag, value]
    return argv + [
        "--min-free-gib",
        str(args.min_free_gib),
        "--write-mib",
        str(args.write_mib),
        "--iters",
        str(args.iters),
        "--timeout-s",
        str(args.timeout_s),
    ]


def run(args: argparse.Namespace) -> int:
    from seektrain.doctor.run import doctor_here, doctor_worker
    from seektrain.launch.elastic import LaunchOptions, launch

    opts = _options(args)
    if args.nproc_per_node < 1:
        raise UserError("--nproc-per-node must be >= 1")
    under_launcher = "LOCAL_RANK" in os.environ
    launch_opts = LaunchOptions(
        args.nproc_per_node,
        args.nnodes,
        args.node_rank,
        args.rdzv_endpoint,
        args.rdzv_id,
        0,
        rdzv_timeout_s=args.rdzv_timeout,
    )
    if not under_launcher:
        launch_opts.validate()  # a bad --node-rank or --nnodes is refused on one node too
    if not under_launcher and (args.nproc_per_node > 1 or launch_opts.multi_node):
        return launch(launch_opts, _worker_argv(args), what="doctor")
    if under_launcher:
        report = doctor_worker(opts, args.timeout_s)
    elif args.comm:
        raise UserError(
            "--comm measures collectives between ranks: add --nproc-per-node N (N >= 2) or --nnodes"
        )
    else:
        report = doctor_here(opts)
    if report is None:  # not rank 0
        return EXIT_OK
    print(report.to_json() if args.json else report.render())
    sys.stdout.flush()
    return report.exit_code
