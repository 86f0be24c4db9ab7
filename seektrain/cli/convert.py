"""``seektrain convert``: move model weights between formats.

A conversion is one *source* (where the model comes from) and one *sink* (where it goes). Each is a
small function registered in ``SOURCES`` / ``SINKS`` together with the flag that selects it, so adding a
format (e.g. our training checkpoints) means adding one loader, one writer and their flags; the handler
itself does not change. Today:

    seektrain convert --from-hf HF_DIR --to-hf OUT_DIR [--dtype bf16]      # e.g. dequantise FP8 V3
    seektrain convert --preset tiny-v3 --to-hf OUT_DIR --seed 0             # random init of a preset
    seektrain convert --from-checkpoint RUN_DIR[/checkpoints/step-N] --to-hf OUT_DIR   # export a run
    seektrain convert --preset tiny-v3 --to-hf OUT_DIR --tokenizer TOKENIZER_DIR       # ... with a tokenizer
    seektrain convert --from-hf HF_DIR --to-checkpoint RUN_DIR              # start a run from released weights

User errors (a missing file, a wrong shape...) print one line on stderr and exit with status 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from seektrain.cli.arg_types import SEED
from seektrain.config.dtypes import dtype_from_name
from seektrain.data.hf_tokenizer import write_hf_tokenizer
from seektrain.errors import UserError, user_path

EXIT_USER_ERROR = 2


def _load_hf(args: argparse.Namespace):
    from seektrain.models.hf_config import read_config_json
    from seektrain.models.hf_io import from_pretrained

    if args.dtype is None and getattr(args, "to_checkpoint", None):
        args.dtype = torch.float32  # training checkpoints hold fp32 master weights
    if args.dtype is None:  # keep the source's dtype (FP8 releases declare bfloat16 here)
        declared = read_config_json(args.from_hf, "--from-hf")
        declared = declared.get("torch_dtype") or declared.get("dtype") or "float32"
        try:
            args.dtype = dtype_from_name(declared)
        except ValueError:  # e.g. float8 weights: the output keeps full precision
            args.dtype = torch.float32
    # Load straight into the output dtype: FP8 dequantisation runs in fp32 one tensor at a time, so
    # nothing is lost, and a bf16 output needs half the memory of an fp32 detour.
    return from_pretrained(args.from_hf, dtype=args.dtype, what="--from-hf")


def _random_preset(args: argparse.Namespace):
    from seektrain.models import build_model, get_preset

    return build_model(get_preset(args.preset), dtype=args.dtype or torch.float32, seed=args.seed)


def _save_hf(model, args: argparse.Namespace) -> str:
    from seektrain.checkpoint.atomic import write_swapped
    from seektrain.models.hf_config import config_to_hf
    from seektrain.models.hf_io import save_pretrained

    out = _check_hf_target(args, config_to_hf(model.cfg, "float32"))
    tokenizer = _tokenizer_source(args)

    def write(tmp: Path) -> tuple[list[str], list[str]]:
        weights = save_pretrained(model, tmp, dtype=args.dtype, max_shard_bytes=args.max_shard_size)
        return weights, (write_hf_tokenizer(tokenizer, tmp, model.cfg.vocab_size) if tokenizer else [])

    weights, extra = write_swapped(out, write)
    also = f"; {', '.join(extra)}" if extra else "; no tokenizer (pass --tokenizer to add one)"
    return f"wrote {args.to_hf} ({len(weights)} weight file{'s' * (len(weights) > 1)}{also})"


def _tokenizer_source(args: argparse.Namespace) -> Path | None:
    """The tokenizer folder the --to-hf folder gets: --tokenizer, else the source's own (a run folder's
    ``tokenizer/`` copy, a Hugging Face folder's files); None when there is none."""
    from seektrain.checkpoint.finder import resolve_checkpoint
    from seektrain.data.tokenizer_files import RUN_TOKENIZER_DIR, tokenizer_folder
    from seektrain.models.hub import resolve_local_path

    if args.tokenizer:
        folder = tokenizer_folder(args.tokenizer)
        if folder is None or not (folder / "tokenizer.json").is_file():
            raise UserError(
                f"--tokenizer {args.tokenizer}: no tokenizer.json there; name a Hugging Face "
                "tokenizer folder or its tokenizer.json"
            )
        return folder
    if args.from_checkpoint:  # RUN/checkpoints/step-N (or RUN/checkpoints.before-*/step-N) -> RUN
        folder = resolve_checkpoint(args.from_checkpoint).parent.parent / RUN_TOKENIZER_DIR
    elif args.from_hf:
        folder = resolve_local_path(args.from_hf, "--from-hf")
    else:
        return None
    return folder if (folder / "tokenizer.json").is_file() else None


def _check_hf_target(args: argparse.Namespace, new_config: dict | None) -> Path:
    """The --to-hf folder, once ``check_target`` agrees that writing there loses nothing."""
    from seektrain.models.hf_replace import check_target

    out = Path(args.to_hf).expanduser()
    sources = tuple(Path(p).expanduser() for p in (args.from_hf,) if p and Path(p).expanduser().is_dir())
    check_target(out, new_config, args.force, sources)
    return out


def _load_checkpoint(args: argparse.Namespace):
    from seektrain.checkpoint.export import load_run_checkpoint

    model, _ckpt = load_run_checkpoint(args.from_checkpoint)
    return model


def _save_checkpoint(model, args: argparse.Namespace) -> str:
    from seektrain.checkpoint.export import write_initial_checkpoint

    path = write_initial_checkpoint(model, args.to_checkpoint, source=str(args.from_hf or args.preset or ""))
    return (
        f"wrote {path} (weights only, step 0); train with --set run.dir={args.to_checkpoint} to start from it"
    )


# dest of the argparse option -> function. The first source/sink whose option is set is used.
SOURCES: dict[str, Callable[[argparse.Namespace], torch.nn.Module]] = {
    "from_hf": _load_hf,
    "preset": _random_preset,
    "from_checkpoint": _load_checkpoint,
}
SINKS: dict[str, Callable[[torch.nn.Module, argparse.Namespace], str]] = {
    "to_hf": _save_hf,
    "to_checkpoint": _save_checkpoint,
}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or plain bytes -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 5GB or 500MB)")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    size = int(float(m.group(1)) * base**power)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size (try 5GB or 500MB)")
    return size


def parse_dtype(text: str) -> torch.dtype:
    try:
        return dtype_from_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("source (exactly one)")
    src.add_argument(
        "--from-hf",
        metavar="HF_DIR",
        help="a Hugging Face folder (config.json + safetensors), or a hub id org/name in the local cache",
    )
    src.add_argument(
        "--preset", metavar="NAME", help="randomly initialise a model preset (see docs/models.md)"
    )
    src.add_argument(
        "--from-checkpoint",
        metavar="RUN_DIR[/checkpoints/step-N]",
        help="a training checkpoint: a run dir (its newest valid checkpoint) or one step folder",
    )
    dst = parser.add_argument_group("destination (exactly one)")
    dst.add_argument("--to-hf", metavar="OUT_DIR", help="write a Hugging Face folder (release layout)")
    dst.add_argument(
        "--to-checkpoint",
        metavar="RUN_DIR",
        help="write a weights-only step-0 training checkpoint into a new run dir (fp32)",
    )
    opts = parser.add_argument_group("conversion options")
    opts.add_argument(
        "--dtype",
        type=parse_dtype,
        default=None,
        help="weight dtype of the output: bf16, fp16 or fp32 (default: the torch_dtype of "
        "--from-hf's config.json, fp32 for --preset)",
    )
    opts.add_argument("--seed", type=SEED, default=0, help="seed of the random initialisation (--preset)")
    opts.add_argument(
        "--force",
        action="store_true",
        help="--to-hf: replace a different model in OUT_DIR (only a folder of config.json and "
        "safetensors; any other file there is never replaced)",
    )
    opts.add_argument(
        "--tokenizer",
        metavar="TOKENIZER",
        help="--to-hf: the tokenizer folder (or tokenizer.json) to write beside the weights, with "
        "generation_config.json (default: the source's own: a run's tokenizer/, a Hugging "
        "Face folder's files)",
    )
    opts.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="5GB",
        help="split the safetensors above this size (default 5GB)",
    )


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``convert`` to the main CLI's subparsers; the handler is stored as ``handler`` (and ``func``)."""
    parser = subparsers.add_parser(
        "convert",
        help="convert model weights between formats",
        description="Convert model weights between formats (exactly one source, one destination).",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run, func=run)
    return parser


def _pick(args: argparse.Namespace, table: dict, what: str) -> str:
    chosen = [dest for dest in table if getattr(args, dest, None) is not None]
    flags = " or ".join("--" + dest.replace("_", "-") for dest in table)
    if len(chosen) != 1:
        raise UserError(f"give exactly one {what}: {flags}")
    return chosen[0]


def run(args: argparse.Namespace) -> int:
    """Handler of ``seektrain convert``; returns the exit status."""
    try:
        source = _pick(args, SOURCES, "source")
        sink = _pick(args, SINKS, "destination")
        if sink == "to_hf":  # refuse a folder we may not replace before a long load of the source
            _check_hf_target(args, None)
        model = SOURCES[source](args)
        with user_path(f"--{sink.replace('_', '-')} {getattr(args, sink)}"):  # a folder we cannot write
            message = SINKS[sink](model, args)
    except UserError as exc:
        print(f"seektrain convert: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(message)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m seektrain.cli.convert``), also handy in tests."""
    parser = argparse.ArgumentParser(prog="seektrain")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
