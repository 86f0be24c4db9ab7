"""`seektrain launch TARGET`: write the files that start a training job on a cluster.

Each target lives in its own `launch_<target>` module with a ``register(launch_subparsers)``; this verb
only gathers them. Nothing is submitted: the user reads the output and applies it.
"""

from __future__ import annotations

import argparse

from seektrain.cli import launch_k8s, launch_slurm


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="write cluster job files (Kubernetes manifests, sbatch scripts) for a training run"
    )
    targets = p.add_subparsers(dest="launch_target", required=True, metavar="TARGET")
    for module in (launch_k8s, launch_slurm):
        module.register(targets)
