"""`seektrain plan`: which layout fits a model on given hardware, and how fast it should run, before a
GPU-hour is spent (seektrain/plan/: memory, speed, search, report; docs/planning.md)."""

from __future__ import annotations

import argparse
import json

from seektrain.cli.arg_types import int_in
from seektrain.cli.config_args import add_config_args
from seektrain.errors import UserError
from seektrain.exit_codes import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="predict memory and speed of every layout on given hardware, print the best"
    )
    p.add_argument("--model", help="preset name (seektrain models) or a Hugging Face model folder")
    add_config_args(p, "TOML config file (its model, batch, precision and schedule)")
    p.add_argument(
        "--gpus",
        type=int_in(1),
        default=0,
        help="devices in all (one rank each); omitted: the fewest with a feasible layout",
    )
    p.add_argument("--gpu", required=True, help="h100-80g, h200, h800, a100-80g, a100-40g or cpu")
    p.add_argument("--nodes", type=int_in(1), default=0, help="nodes (default: 8 GPUs per node; cpu: 1)")
    p.add_argument(
        "--seq",
        type=int_in(1),
        default=None,
        help="tokens per sequence (default: the config's, or 4096 with --model)",
    )
    p.add_argument(
        "--global-batch",
        type=int_in(1),
        default=None,
        help="sequences per step (default: the config's, or 4 per device with --model)",
    )
    p.add_argument("--top", type=int_in(1), default=5, help="ranked layouts to show")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


PER_DEVICE_BATCH = 4  # --model without --global-batch: sequences per device


def job_and_model(args: argparse.Namespace, gpus: int | None = None):
    """The job config and model the plan is for; --model replaces the config's model. ``gpus``: the
    device count the default global batch follows (``args.gpus`` unless the planner chooses it)."""
    from seektrain.config.loader import load_config
    from seektrain.models import preset_names
    from seektrain.models.job_model import configured_model_config

    overrides = ["train.micro_batch_size=1", *args.overrides]  # the search tries micro-batch sizes itself
    if args.model:
        key = "model.preset" if args.model in preset_names() else "model.hf_path"
        overrides.append(f"{key}={args.model}")
    if not args.config and not args.model:
        raise UserError("seektrain plan needs --model PRESET|HF_DIR or --config FILE")
    default_seq = 0 if args.config else 4096
    seq = args.seq if args.seq is not None else default_seq
    if seq:
        overrides.append(f"train.seq_len={seq}")
    gpus = args.gpus if gpus is None else gpus
    batch = (
        args.global_batch
        if args.global_batch is not None
        else (0 if args.config else PER_DEVICE_BATCH * gpus)
    )
    if batch:
        overrides.append(f"train.global_batch_size={batch}")
    job = load_config(args.config, overrides)
    if job.model.hf_path:  # the plan needs config.json only: the weights may not be downloaded yet
        from seektrain.models import declared_config

        return job, declared_config(job.model.hf_path)
    return job, configured_model_config(job)


def run(args: argparse.Namespace) -> int:
    from seektrain.plan.planner import fewest_gpus, plan_job

    if args.gpus < 0 or (args.gpus == 0 and args.nodes):
        raise UserError(
            f"--gpus={args.gpus}: give a count >= 1 (with --nodes), or leave it out for the fewest"
        )
    gpus = args.gpus
    if not gpus:  # the fewest devices any layout fits on, then the full plan for that count
        job, model = job_and_model(args, 1)
        follows = 0 if args.global_batch or args.config else PER_DEVICE_BATCH
        gpus = fewest_gpus(job, model, args.gpu, follows)
    job, model = job_and_model(args, gpus)
    data = plan_job(job, model, gpus, args.gpu, args.nodes, args.top)
    if not args.gpus:
        data["fewest_gpus"] = gpus
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        from seektrain.plan.report import format_text

        print(format_text(data))
    return EXIT_OK
