"""`seektrain config show`: the fully resolved config (defaults + file + overrides) as TOML.
`seektrain config keys`: every key with its type, default and one line of help, from the schema.
`seektrain config from-deepspeed`: a DeepSpeed ds_config.json as our TOML, each imported key commented
with the DeepSpeed key it came from (the mapping is seektrain/config/deepspeed.py)."""

from __future__ import annotations

import argparse
import os
import sys

from seektrain.cli.config_args import add_config_args
from seektrain.config.loader import config_to_toml, load_config
from seektrain.exit_codes import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="inspect configs and list their keys")
    verbs = p.add_subparsers(dest="config_verb", required=True)
    show = verbs.add_parser("show", help="print the resolved config as TOML")
    add_config_args(show, "TOML config file")
    show.add_argument("--comments", action="store_true", help="put each key's help above it")
    show.set_defaults(handler=run_show)
    keys = verbs.add_parser("keys", help="list every config key: section.key, type, default, help")
    keys.add_argument("--markdown", action="store_true", help="print a Markdown table instead")
    keys.set_defaults(handler=run_keys)
    ds = verbs.add_parser(
        "from-deepspeed",
        help="print a DeepSpeed ds_config.json as a seektrain TOML config",
        description="Map a DeepSpeed config onto seektrain's keys and print the full TOML "
        "(over --config, under --set); notes say what seektrain does instead "
        "of what it does not have.",
    )
    ds.add_argument("deepspeed", metavar="DS_CONFIG.json")
    ds.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes (GPUs) of the run, for DeepSpeed's batch rule when the file needs it",
    )
    add_config_args(ds, "TOML config the DeepSpeed file is applied over (default: built-in)")
    ds.set_defaults(handler=run_from_deepspeed)


def run_show(args: argparse.Namespace) -> int:
    from seektrain.models.job_model import check_preset

    cfg = load_config(args.config, args.overrides)
    check_preset(cfg)
    print(config_to_toml(cfg, comments=args.comments), end="")
    return EXIT_OK


def run_keys(args: argparse.Namespace) -> int:
    from seektrain.config.reference import config_keys, format_keys

    print(format_keys(config_keys(), markdown=args.markdown), end="")
    return EXIT_OK


def run_from_deepspeed(args: argparse.Namespace) -> int:
    from seektrain.config.deepspeed import load_config_with_deepspeed

    cfg, imported = load_config_with_deepspeed(args.deepspeed, args.config, args.overrides, args.world_size)
    sources = imported.sources()
    lines = [
        f"# seektrain config imported from DeepSpeed {args.deepspeed}"
        + (f" for world size {args.world_size}" if args.world_size else "")
    ]
    lines += [f"# note: {note}" for note in imported.notes]
    section = ""
    for line in config_to_toml(cfg).splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        key = f"{section}.{line.partition(' = ')[0]}"
        if " = " in line and key in sources:
            lines.append(f"# from DeepSpeed {sources[key]}")
        lines.append(line)
    print("\n".join(lines))
    return EXIT_OK


def deepspeed_overrides(args: argparse.Namespace) -> list[str]:
    """For `seektrain train --deepspeed F`: the DeepSpeed file as --set items placed before the user's
    own, so the launcher hands workers plain overrides. The batch rule uses the launch's world size
    (none for an elastic MIN:MAX node count). The notes are printed once: workers that this launcher
    started get the overrides, not the file."""
    from seektrain.config.deepspeed import load_config_with_deepspeed
    from seektrain.launch.elastic import LaunchOptions

    if "LOCAL_RANK" in os.environ:  # a worker of torchrun
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        world_size = LaunchOptions(args.nproc_per_node, args.nnodes).fixed_world_size()
    _, imported = load_config_with_deepspeed(args.deepspeed, args.config, args.overrides, world_size)
    if os.environ.get("RANK", "0") == "0":
        for note in imported.notes:
            print(f"seektrain: deepspeed: {note}", file=sys.stderr)
    return [*imported.overrides(), *args.overrides]
