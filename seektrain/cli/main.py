"""The `seektrain` command: one verb per job. User mistakes print one line and exit 2."""

from __future__ import annotations

import argparse
import sys

from seektrain.checkpoint.manager import CheckpointError
from seektrain.cli import (config_cmd, convert, data_cmd, doctor_cmd, flops_cmd, launch_cmd, models_cmd,
                           plan_cmd, sample_cmd, train_cmd)
from seektrain.train.out_of_memory import OutOfMemory
from seektrain.version import version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seektrain", description="Train DeepSeek-family models with PyTorch.")
    parser.add_argument("--version", action="version", version=f"seektrain {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (train_cmd, launch_cmd, models_cmd, config_cmd, sample_cmd, data_cmd, convert, flops_cmd,
                   doctor_cmd, plan_cmd):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("seektrain: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, CheckpointError, OutOfMemory) as err:
        print(f"seektrain: error: {err}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
