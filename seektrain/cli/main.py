"""The `seektrain` command: one verb per job. Bad input (``UserError``) and a known failure of the run
(``RunFailure``) print one line and exit 2; anything else is a bug: one line saying where its traceback
was written, exit 1 (``cli/error_lines.py``)."""

from __future__ import annotations

import argparse
import sys

from seektrain.cli import (
    chat_cmd,
    config_cmd,
    convert,
    data_cmd,
    doctor_cmd,
    flops_cmd,
    launch_cmd,
    models_cmd,
    plan_cmd,
    sample_cmd,
    train_cmd,
)
from seektrain.cli.error_lines import OneLineParser, report_internal_error, report_user_error
from seektrain.errors import RunFailure, UserError
from seektrain.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR
from seektrain.version import version


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="seektrain", description="Train DeepSeek-family models with PyTorch.")
    parser.add_argument("--version", action="version", version=f"seektrain {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (
        train_cmd,
        launch_cmd,
        models_cmd,
        config_cmd,
        sample_cmd,
        data_cmd,
        convert,
        flops_cmd,
        doctor_cmd,
        plan_cmd,
        chat_cmd,
    ):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a flag refused with one line
        return int(done.code or EXIT_OK) if not isinstance(done.code, str) else EXIT_USER_ERROR
    try:
        return int(args.handler(args) or EXIT_OK)
    except KeyboardInterrupt:
        print("seektrain: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (UserError, RunFailure) as err:
        return report_user_error(err)
    except Exception as err:  # a bug: its traceback goes to the run's train.log, one line here
        return report_internal_error(err, _run_dir(args))


def _run_dir(args: argparse.Namespace) -> str | None:
    """run.dir of a train/flops command (whose config is valid by now), where train.log lives."""
    if getattr(args, "command", None) != "train":
        return None
    try:
        from seektrain.config.loader import load_config

        return load_config(args.config, args.overrides).run.dir
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
