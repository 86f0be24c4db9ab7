"""`seektrain config show`: the fully resolved config (defaults + file + overrides) as TOML.
`seektrain config keys`: every key with its type, default and one line of help, from the schema."""

from __future__ import annotations

import argparse

from seektrain.config.loader import config_to_toml, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="inspect configs and list their keys")
    verbs = p.add_subparsers(dest="config_verb", required=True)
    show = verbs.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("--config", help="TOML config file")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    show.add_argument("--comments", action="store_true", help="put each key's help above it")
    show.set_defaults(handler=run_show)
    keys = verbs.add_parser("keys", help="list every config key: section.key, type, default, help")
    keys.add_argument("--markdown", action="store_true", help="print a Markdown table instead")
    keys.set_defaults(handler=run_keys)


def run_show(args: argparse.Namespace) -> int:
    print(config_to_toml(load_config(args.config, args.overrides), comments=args.comments), end="")
    return 0


def run_keys(args: argparse.Namespace) -> int:
    from seektrain.config.reference import config_keys, format_keys

    print(format_keys(config_keys(), markdown=args.markdown), end="")
    return 0
