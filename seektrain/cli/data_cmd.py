"""``seektrain data prepare|info|verify``: the command-line face of :mod:`seektrain.data`.

Handlers take the parsed namespace and return an exit code; user mistakes surface as one-line
``ValueError``s for the top-level ``main`` to print.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from seektrain.cli.arg_types import float_in, int_in, nonempty
from seektrain.data.dataset import verify_dataset
from seektrain.data.manifest import Manifest, read_manifest
from seektrain.data.prepare import DEFAULT_SHARD_TOKENS, prepare_dataset
from seektrain.data.sources import FORMATS


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``data`` command (with ``prepare``, ``info`` and ``verify``) to an argparse subparsers object."""
    data = subparsers.add_parser("data", help="prepare and inspect tokenized datasets")
    data.set_defaults(handler=lambda args: _usage(data))
    sub = data.add_subparsers(dest="data_command", metavar="{prepare,info,verify}")

    p = sub.add_parser("prepare", help="tokenize text/jsonl/parquet files into token shards + manifest.json")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories (walked recursively)")
    p.add_argument("--output", required=True, metavar="DIR", help="directory to create")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (built-in), a path to a Hugging Face tokenizer.json, or a cached hub id org/name")
    p.add_argument("--format", default="auto", choices=FORMATS, help="input format; auto picks by file extension")
    p.add_argument("--text-field", type=nonempty, default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--shard-tokens", type=int_in(1), default=DEFAULT_SHARD_TOKENS, metavar="N", help="tokens per shard file")
    p.add_argument("--val-fraction", type=float_in(0, below=1), default=0.01, help="fraction of documents held out for validation")
    p.add_argument("--max-tokens", type=int_in(1), default=None, metavar="N", help="stop after the document reaching N tokens")
    p.add_argument("--force", action="store_true",
                   help="replace an existing dataset folder made by `data prepare` (never any other folder)")
    p.set_defaults(handler=run_prepare)

    i = sub.add_parser("info", help="print the summary of a prepared dataset")
    i.add_argument("dir", metavar="DIR")
    i.set_defaults(handler=run_info)

    v = sub.add_parser("verify", help="check sizes and sha256 of every shard of a prepared dataset")
    v.add_argument("dir", metavar="DIR")
    v.set_defaults(handler=run_verify)
    return data


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_prepare(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    manifest = prepare_dataset(
        args.input,
        args.output,
        args.tokenizer,
        fmt=args.format,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
        val_fraction=args.val_fraction,
        max_tokens=args.max_tokens,
        force=args.force,
    )
    print(f"prepared {args.output} in {time.perf_counter() - start:.1f}s")
    print(summary(manifest))
    return 0


def run_info(args: argparse.Namespace) -> int:
    print(f"dataset   {args.dir}")
    print(summary(read_manifest(args.dir)))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    manifest = verify_dataset(args.dir)
    shards = len(manifest.train.shards) + len(manifest.val.shards)
    print(f"ok: {shards} shards, {manifest.total_tokens:,} tokens, sizes and sha256 match manifest.json")
    return 0


def summary(m: Manifest) -> str:
    tok = m.tokenizer
    lines = [
        f"tokenizer {tok.spec} (vocab {tok.vocab_size}, eos {tok.eos_id}, bos {tok.bos_id})",
        f"dtype     {m.dtype}",
        f"sources   {len(m.sources)} files, {m.documents:,} documents, {m.total_tokens:,} tokens",
    ]
    for name in ("train", "val"):
        s = m.split(name)
        lines.append(f"{name:<9} {s.documents:,} documents, {s.tokens:,} tokens in {len(s.shards)} shards")
    return "\n".join(lines)
