"""`seektrain launch k8s`: Kubernetes manifests for a multi-node training job (seektrain/launch/k8s.py).

The config is loaded, validated and its layout resolved for nodes x GPUs ranks here, so a job that
cannot run is refused before any manifest is written.
"""

from __future__ import annotations

import argparse
import sys

from seektrain.cli.config_args import add_config_args
from seektrain.cli.launch_output import write_launch_file
from seektrain.errors import UserError
from seektrain.exit_codes import EXIT_OK
from seektrain.launch.image import DEFAULT_IMAGE
from seektrain.launch.k8s import GENERATED_MARK, KINDS, K8sOptions, build_manifests, cluster_config
from seektrain.launch.yaml_text import to_yaml_documents


def register(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser(
        "k8s",
        help="Kubernetes manifests: Indexed Job, JobSet or Kubeflow PyTorchJob",
        description="Write the manifests (multi-document YAML) that train --config on "
        "--nodes pods of --gpus-per-node GPUs; apply them with kubectl apply -f.",
    )
    add_config_args(p, "TOML config file (default: the built-in tiny-v3 run)")
    p.add_argument("--nodes", type=int, required=True, help="pods, one per node")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (and worker processes) per pod")
    p.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help=f"container image (default: {DEFAULT_IMAGE}, built from deploy/docker/Dockerfile)",
    )
    p.add_argument(
        "--kind",
        choices=KINDS,
        default="indexed-job",
        help="workload kind: indexed-job (any cluster), jobset (JobSet controller) or pytorchjob "
        "(Kubeflow training operator); default indexed-job",
    )
    p.add_argument("--name", default="", help="job name (default: the run folder's name)")
    p.add_argument("--namespace", default="", help="namespace of every object (default: kubectl's)")
    p.add_argument(
        "--pvc", default="", help="existing PersistentVolumeClaim for the run folder (default: emit one)"
    )
    p.add_argument(
        "--pvc-size",
        default="",
        help="size of the emitted claim (default: room for checkpoint.keep + 1 checkpoints of the model)",
    )
    p.add_argument(
        "--storage-class",
        default="",
        help="storage class of the emitted claim (several nodes need one that offers ReadWriteMany)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="worker restarts inside a pod, and whole-job restarts by the cluster (default 3)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra container environment, e.g. NCCL_IB_HCA=mlx5 (repeatable)",
    )
    p.add_argument(
        "-o",
        "--output",
        default="",
        help="write to this file (default: stdout); an existing file only if seektrain wrote it",
    )
    p.add_argument(
        "--force", action="store_true", help="with -o: replace an existing file seektrain did not write"
    )
    p.set_defaults(handler=run)


def _env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--env {item!r} must look like NAME=VALUE")
        env[key] = value
    return env


def run(args: argparse.Namespace) -> int:
    from seektrain.config.loader import config_to_toml

    opts = K8sOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        image=args.image,
        kind=args.kind,
        name=args.name,
        namespace=args.namespace,
        pvc=args.pvc,
        pvc_size=args.pvc_size,
        storage_class=args.storage_class,
        max_restarts=args.max_restarts,
        env=_env(args.env),
    )
    opts.check()
    cfg = cluster_config(args.config, args.overrides, opts.nodes * opts.gpus_per_node)
    text = f"{GENERATED_MARK}; regenerate rather than edit\n" + to_yaml_documents(
        build_manifests(cfg, opts, config_to_toml(cfg))
    )
    if args.output:
        write_launch_file(args.output, text, GENERATED_MARK, config=args.config, force=args.force)
        print(
            f"seektrain: wrote {args.output}; start it with: kubectl apply -f {args.output}", file=sys.stderr
        )
    else:
        sys.stdout.write(text)
    if not cfg.metrics.prometheus_port:
        print(
            "seektrain: note: metrics.prometheus_port is 0, so the pods carry no Prometheus scrape "
            "annotations (add --set metrics.prometheus_port=9090 to scrape them)",
            file=sys.stderr,
        )
    return EXIT_OK
