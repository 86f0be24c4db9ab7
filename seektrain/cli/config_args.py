"""``--config FILE`` and ``--set SECTION.KEY=VALUE``: the two flags every verb that reads a job config
takes, declared once so that their names, metavar and repeatability agree across ``train``, ``plan``,
``doctor``, ``flops``, ``config show``, ``config from-deepspeed`` and the launchers, and handed on to
worker processes the same way."""

from __future__ import annotations

import argparse

SET_HELP = "override one config key (repeatable; `seektrain config keys` lists them)"


def add_config_args(
    parser: argparse.ArgumentParser, config_help: str, *, required: bool = False, set_help: str = SET_HELP
) -> None:
    """Add ``--config`` (``args.config``) and the repeatable ``--set`` (``args.overrides``)."""
    parser.add_argument("--config", required=required, help=config_help)
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=set_help
    )


def config_argv(args: argparse.Namespace) -> list[str]:
    """The same two flags as a worker's command line (``torchrun ... -m seektrain <verb> ...``)."""
    argv = ["--config", args.config] if args.config else []
    for item in args.overrides:
        argv += ["--set", item]
    return argv
