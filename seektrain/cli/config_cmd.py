"""`seektrain config show`: the fully resolved config (defaults + file + overrides) as TOML."""

from __future__ import annotations

import argparse

from seektrain.config.loader import config_to_toml, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="inspect configs")
    verbs = p.add_subparsers(dest="config_verb", required=True)
    show = verbs.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("--config", help="TOML config file")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    show.set_defaults(handler=run_show)


def run_show(args: argparse.Namespace) -> int:
    print(config_to_toml(load_config(args.config, args.overrides)), end="")
    return 0
