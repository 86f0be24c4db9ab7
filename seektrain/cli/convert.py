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
    seektrain convert --from-checkpoint LORA_RUN --to-peft OUT_DIR          # a LoRA run's adapters for peft
    seektrain convert --from-checkpoint LORA_RUN --merge-lora --to-hf OUT_DIR   # base + adapters, merged

User errors (a missing file, a wrong shape...) print one line on stderr and exit with status 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from seektrain.cli.arg_types import SEED
from seektrain.data.hf_tokenizer import write_hf_tokenizer
from seektrain.errors import UserError, user_path
from seektrain.exit_codes import EXIT_OK, EXIT_USER_ERROR

if TYPE_CHECKING:  # torch is imported by the functions that convert, not by `seektrain --help`
    import torch

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _load_hf(args: argparse.Namespace):
    import torch

    from seektrain.config.dtypes import dtype_from_name
    from seektrain.models import from_pretrained, read_config_json

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
    import torch

    from seektrain.models import build_model, get_preset

    return build_model(get_preset(args.preset), dtype=args.dtype or torch.float32, seed=args.seed)


def _save_hf(model, args: argparse.Namespace) -> str:
    from seektrain.models import save_pretrained

    if args.merge_lora:
        model = _merged(model, _lora_source(args)[1])
    return _write_hf(
        args,
        model.cfg,
        lambda tmp: save_pretrained(model, tmp, dtype=args.dtype, max_shard_bytes=args.max_shard_size),
    )


def _streamed_hf(args: argparse.Namespace) -> str | None:
    """--from-checkpoint --to-hf written piece by piece (checkpoint/hf_export_run.py), the model never
    whole in this process; None where that does not apply (a LoRA checkpoint of a preset base)."""
    from seektrain.checkpoint.hf_export_run import streamed_export

    found = streamed_export(args.from_checkpoint, args.base, args.dtype)
    if found is None:
        return None
    cfg, write_weights = found
    return _write_hf(args, cfg, lambda tmp: write_weights(tmp, args.max_shard_size))


def _write_hf(args: argparse.Namespace, cfg, write_weights) -> str:
    """The --to-hf folder: weights (``write_weights(tmp_dir)`` -> their file names), the tokenizer,
    swapped into place only once complete."""
    from seektrain.checkpoint.atomic import write_swapped
    from seektrain.models import config_to_hf

    out = _check_hf_target(args, config_to_hf(cfg, "float32"))
    tokenizer = _tokenizer_source(args)

    def write(tmp: Path) -> tuple[list[str], list[str]]:
        weights = write_weights(tmp)
        return weights, (write_hf_tokenizer(tokenizer, tmp, cfg.vocab_size) if tokenizer else [])

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
    from seektrain.models import check_target

    out = Path(args.to_hf).expanduser()
    sources = tuple(Path(p).expanduser() for p in (args.from_hf,) if p and Path(p).expanduser().is_dir())
    check_target(out, new_config, args.force, sources)
    return out


def _load_checkpoint(args: argparse.Namespace):
    from seektrain.checkpoint.export import load_run_checkpoint

    model, _ckpt = load_run_checkpoint(args.from_checkpoint, base_dir=args.base)
    return model


def _lora_source(args: argparse.Namespace) -> tuple[Path, dict] | None:
    """(checkpoint, its ``"lora"`` record) when the source is a LoRA checkpoint, else None."""
    from seektrain.checkpoint.finder import resolve_checkpoint
    from seektrain.checkpoint.lora_checkpoint import lora_settings

    if not args.from_checkpoint:
        return None
    ckpt = resolve_checkpoint(args.from_checkpoint)
    saved = lora_settings(ckpt)
    return (ckpt, saved) if saved is not None else None


def _check_lora_flags(args: argparse.Namespace, sink: str) -> None:
    """Before loading anything: adapters go out only as PEFT or merged, and only adapters go to PEFT."""
    lora = _lora_source(args)
    source = args.from_checkpoint or args.from_hf or args.preset
    if sink == "to_peft" and lora is None:
        raise UserError(
            f"--to-peft: {source} is not a LoRA checkpoint (it holds no adapters); export a full "
            "model with --to-hf"
        )
    if args.merge_lora and (sink != "to_hf" or lora is None):
        raise UserError(
            "--merge-lora merges a LoRA checkpoint's adapters into its base for --to-hf; "
            + (f"{source} holds no adapters, drop --merge-lora" if lora is None else "use it with --to-hf")
        )
    if sink in ("to_hf", "to_checkpoint") and lora is not None and not args.merge_lora:
        raise UserError(
            f"--from-checkpoint {args.from_checkpoint} holds LoRA adapters, not a full model: add "
            "--merge-lora to write the merged model with --to-hf, or write the adapters with --to-peft"
        )
    if args.base and lora is None:
        raise UserError("--base names the base folder of a LoRA checkpoint; this source has none, drop it")


def _merged(model, saved: dict):
    """A plain model holding ``W + alpha/r · B @ A`` wherever ``model`` has adapters (``saved``: the
    checkpoint's ``"lora"`` record)."""
    from seektrain.checkpoint.lora_checkpoint import spec_of
    from seektrain.models import build_model
    from seektrain.models.lora_export import merged_state_dict

    state = merged_state_dict(model.state_dict(), spec_of(saved).scaling)
    plain = build_model(model.cfg, init=False, dtype=state["embed_tokens.weight"].dtype)
    plain.load_state_dict(state)
    return plain.eval()


def _save_peft(model, args: argparse.Namespace) -> str:
    from safetensors.torch import save_file

    from seektrain.checkpoint.atomic import write_swapped
    from seektrain.checkpoint.lora_base import describe_base
    from seektrain.models.lora import is_adapter
    from seektrain.models.lora_export import peft_config, peft_tensors

    _ckpt, saved = _lora_source(args)
    out = _check_peft_target(args)
    state = model.state_dict()
    base = saved.get("base") or {}
    config = peft_config(
        state,
        saved["rank"],
        saved["alpha"],
        saved["dropout"],
        base.get("path") if base.get("kind") == "hf" else None,
    )
    tensors = peft_tensors(state)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    write_swapped(out, write)
    notes = [f"for {describe_base(base)}"]
    if base.get("kind") != "hf":
        dtype = saved.get("base_dtype", "float32")
        notes.append(
            f"write that base with: seektrain convert --preset {base.get('preset')} --seed "
            f"{base.get('seed')}{'' if dtype == 'float32' else f' --dtype {dtype}'} --to-hf DIR"
        )
    if any(k.startswith("mtp.") and is_adapter(k) for k in state):
        notes.append("MTP adapters left out (transformers builds no MTP layer; --merge-lora keeps them)")
    if config["lora_dropout"] != saved["dropout"]:
        notes.append(
            f"lora_dropout written as 0 (peft's target_parameters refuse dropout), was {saved['dropout']}"
        )
    return f"wrote {args.to_peft} ({len(tensors)} adapter tensors, rank {saved['rank']}; {'; '.join(notes)})"


def _check_peft_target(args: argparse.Namespace) -> Path:
    """The --to-peft folder: new, empty, or an earlier adapter export (replaced); never anything else."""
    out = Path(args.to_peft).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--to-peft {out}: is a file; choose a folder")
    foreign = (
        sorted(p.name for p in out.iterdir() if p.name not in (PEFT_CONFIG, PEFT_WEIGHTS))
        if out.is_dir()
        else []
    )
    if foreign:
        raise UserError(
            f"--to-peft {out}: holds {foreign[0]!r}, which convert does not write, so it will not replace "
            "this folder; choose a new folder"
        )
    return out


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
    "to_peft": _save_peft,
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
    from seektrain.config.dtypes import dtype_from_name

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
    dst.add_argument(
        "--to-peft",
        metavar="OUT_DIR",
        help="write a LoRA checkpoint's adapters as a PEFT adapter folder (adapter_config.json + "
        "adapter_model.safetensors) for transformers' model of its base",
    )
    opts = parser.add_argument_group("conversion options")
    opts.add_argument(
        "--dtype",
        type=parse_dtype,
        default=None,
        help="weight dtype of the output: bf16, fp16 or fp32 (default: the torch_dtype of "
        "--from-hf's config.json, fp32 for --preset)",
    )
    opts.add_argument(
        "--merge-lora",
        action="store_true",
        help="--to-hf from a LoRA checkpoint: write its base with the adapters merged in (W + alpha/r * B @ A)",
    )
    opts.add_argument(
        "--base",
        metavar="HF_DIR",
        help="a LoRA checkpoint's base folder, when it is no longer where training read it (checked "
        "against the fingerprint the checkpoint recorded)",
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
        _check_lora_flags(args, sink)
        if sink == "to_hf":  # refuse a folder we may not replace before a long load of the source
            _check_hf_target(args, None)
        if sink == "to_peft":
            _check_peft_target(args)
        target = user_path(f"--{sink.replace('_', '-')} {getattr(args, sink)}")  # a folder we cannot write
        message = None
        if (source, sink) == ("from_checkpoint", "to_hf"):
            with target:
                message = _streamed_hf(args)
        if message is None:
            model = SOURCES[source](args)
            with user_path(f"--{sink.replace('_', '-')} {getattr(args, sink)}"):
                message = SINKS[sink](model, args)
    except UserError as exc:
        print(f"seektrain convert: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(message)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m seektrain.cli.convert``), also handy in tests."""
    parser = argparse.ArgumentParser(prog="seektrain")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
