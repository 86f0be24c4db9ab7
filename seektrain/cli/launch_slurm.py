"""`seektrain launch slurm`: write an sbatch script that trains on N nodes (seektrain/launch/slurm.py)."""

from __future__ import annotations

import argparse
import sys

from seektrain.cli.config_args import add_config_args
from seektrain.exit_codes import EXIT_OK
from seektrain.launch.image import DEFAULT_IMAGE


def register(launch_sub: argparse._SubParsersAction) -> None:
    p = launch_sub.add_parser(
        "slurm",
        help="write an sbatch script: one srun task per node, preemption-safe, requeued on SIGTERM",
        description="Write an sbatch script that runs `seektrain train` on every node of a Slurm job. "
        "The config and the layout are checked now; run.dir must be absolute (shared storage).",
        epilog="docs/multinode.md#slurm explains the script",
    )
    add_config_args(
        p,
        "TOML config file (on storage every node sees)",
        required=True,
        set_help="override one config key (repeatable), written into the script",
    )
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs per node, one worker each (0 = CPU)"
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="worker processes per node on CPU nodes (default: --gpus-per-node, or 1)",
    )
    p.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs for each node's task (default: 8 per worker process)",
    )
    p.add_argument("--partition", default="", help="sbatch --partition")
    p.add_argument(
        "--time", default="", help="sbatch --time limit, e.g. 24:00:00 (training stops in time to save)"
    )
    p.add_argument("--account", default="", help="sbatch --account")
    p.add_argument(
        "--image",
        nargs="?",
        const=DEFAULT_IMAGE,
        default="",
        metavar="IMG",
        help=f"run inside this container image with pyxis (srun --container-image); --image alone: "
        f"{DEFAULT_IMAGE}, what deploy/docker/Dockerfile builds",
    )
    p.add_argument(
        "-o",
        "--output",
        default="",
        help="write the script here (default: stdout); an existing file only if seektrain wrote it",
    )
    p.add_argument(
        "--force", action="store_true", help="with -o: replace an existing file seektrain did not write"
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from seektrain.cli.launch_output import write_launch_file
    from seektrain.launch.slurm import GENERATED_MARK, plan_slurm_job, render_sbatch

    job = plan_slurm_job(
        args.config,
        args.overrides,
        args.nodes,
        args.gpus_per_node,
        nproc_per_node=args.nproc_per_node,
        cpus_per_task=args.cpus_per_task,
        partition=args.partition,
        time=args.time,
        account=args.account,
        image=args.image,
        python=sys.executable,
    )
    for note in job.notes:
        print(f"seektrain: note: {note}", file=sys.stderr)
    script = render_sbatch(job)
    out = None
    if args.output:  # refused (an existing foreign file, the config) before anything is created
        out = write_launch_file(
            args.output, script, GENERATED_MARK, config=args.config, force=args.force, executable=True
        )
    try:  # Slurm writes the job log into run.dir but creates no folder: without it the job fails silently
        job.run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(
            f"seektrain: note: could not create run.dir {job.run_dir} here ({err.strerror}); create it on the "
            "cluster before sbatch, or the job cannot write its log",
            file=sys.stderr,
        )
    if out is None:
        sys.stdout.write(script)
        return EXIT_OK
    print(
        f"wrote {out}: submit it with `sbatch {out}`; the job log goes to {job.run_dir}/slurm-JOBID.out",
        file=sys.stderr,
    )
    return EXIT_OK
