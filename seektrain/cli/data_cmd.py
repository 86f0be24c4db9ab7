"""``seektrain data prepare|info|verify|show``: the command-line face of :mod:`seektrain.data`.

Handlers take the parsed namespace and return an exit code; bad input surfaces as a ``UserError`` that the
top-level ``main`` prints as one line.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from seektrain.cli.arg_types import float_in, int_in, nonempty
from seektrain.cli.data_show import run_show
from seektrain.data.chat_template import BUILTIN_TEMPLATES, TRAIN_ON
from seektrain.data.dataset import verify_dataset
from seektrain.data.manifest import SPLITS, Manifest, read_manifest
from seektrain.data.prepare import DEFAULT_SHARD_TOKENS, OVERLONG, RowOptions, prepare_dataset
from seektrain.data.row_mapping import COLUMN_KEYS, ROLE_KEYS, parse_mapping
from seektrain.data.sources import FORMATS
from seektrain.exit_codes import EXIT_OK, EXIT_USER_ERROR


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``data`` command (``prepare``, ``info``, ``verify``, ``show``) to an argparse subparsers object."""
    data = subparsers.add_parser("data", help="prepare and inspect tokenized datasets")
    data.set_defaults(handler=lambda args: _usage(data))
    sub = data.add_subparsers(dest="data_command", metavar="{prepare,info,verify,show}")

    p = sub.add_parser(
        "prepare",
        help="tokenize text, jsonl, json, parquet files or datasets folders (text, chat, ShareGPT, Alpaca or "
        "prompt/completion rows) into shards + manifest.json",
    )
    p.add_argument(
        "--input",
        nargs="+",
        action="extend",
        required=True,
        metavar="PATH[:WEIGHT]",
        help="files (.gz/.zst too), directories (walked recursively) or Hugging Face save_to_disk folders; "
        "repeat --input PATH:WEIGHT to mix inputs by weight",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="directory to create")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (built-in), a Hugging Face tokenizer folder or its tokenizer.json, or a cached hub id org/name",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=FORMATS,
        help="how files are read (text|jsonl|json|parquet), or what their rows hold (chat: messages, sharegpt: "
        "conversations, alpaca: instruction/input/output, completion: prompt/completion); auto picks by "
        "extension and by each file's first row",
    )
    p.add_argument(
        "--columns",
        default=None,
        metavar="KEY=NAME,...",
        help=f"the data's names for the fields a format reads, e.g. messages=conv,role=from,content=value "
        f"or instruction=question,output=answer (keys: {', '.join(COLUMN_KEYS)})",
    )
    p.add_argument(
        "--roles",
        default=None,
        metavar="ROLE=TAG,...",
        help=f"the data's tags for the roles of chat/ShareGPT turns, e.g. user=human,assistant=gpt "
        f"(roles: {', '.join(ROLE_KEYS)})",
    )
    p.add_argument(
        "--text-field", type=nonempty, default="text", help="JSONL field / Parquet column holding the text"
    )
    p.add_argument(
        "--shard-tokens",
        type=int_in(1),
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help="tokens per shard file",
    )
    p.add_argument(
        "--val-fraction",
        type=float_in(0, below=1),
        default=0.01,
        help="fraction of documents held out for validation",
    )
    p.add_argument(
        "--max-tokens",
        type=int_in(1),
        default=None,
        metavar="N",
        help="stop after the document reaching N tokens",
    )
    p.add_argument(
        "--chat-template",
        choices=BUILTIN_TEMPLATES,
        default=None,
        help="render chat rows with this built-in template instead of the tokenizer folder's own",
    )
    p.add_argument(
        "--train-on",
        choices=TRAIN_ON,
        default="assistant",
        help="which tokens of a chat row are trained: every assistant turn (default), the last one, or all",
    )
    p.add_argument(
        "--max-len",
        type=int_in(2),
        default=None,
        metavar="N",
        help="documents longer than N tokens are dropped or truncated (--overlong); counted in the manifest",
    )
    p.add_argument(
        "--overlong", choices=OVERLONG, default="drop", help="what --max-len does to a longer document"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing dataset folder made by `data prepare` (never any other folder)",
    )
    p.set_defaults(handler=run_prepare)

    i = sub.add_parser("info", help="print the summary of a prepared dataset")
    i.add_argument("dir", metavar="DIR")
    i.set_defaults(handler=run_info)

    v = sub.add_parser("verify", help="check sizes and sha256 of every shard of a prepared dataset")
    v.add_argument("dir", metavar="DIR")
    v.set_defaults(handler=run_verify)

    w = sub.add_parser(
        "show", help="print one document: token ids, loss mask and its text with the trained spans marked"
    )
    w.add_argument("dir", metavar="DIR")
    w.add_argument("--split", choices=SPLITS, default="train", help="which split to read (default: train)")
    w.add_argument(
        "--index", type=int_in(0), default=0, metavar="N", help="document number in the split (from 0)"
    )
    w.add_argument("--json", action="store_true", help='print {"tokens": [...], "loss_mask": [...]} only')
    w.set_defaults(handler=run_show)
    return data


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return EXIT_USER_ERROR


def run_prepare(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    mapping = parse_mapping(args.columns, args.roles)
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
        rows=RowOptions(args.chat_template, args.train_on, args.max_len, args.overlong, mapping),
    )
    print(f"prepared {args.output} in {time.perf_counter() - start:.1f}s")
    print(summary(manifest))
    return EXIT_OK


def run_info(args: argparse.Namespace) -> int:
    print(f"dataset   {args.dir}")
    print(summary(read_manifest(args.dir)))
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    manifest = verify_dataset(args.dir)
    shards = len(manifest.train.shards) + len(manifest.val.shards)
    print(f"ok: {shards} shards, {manifest.total_tokens:,} tokens, sizes and sha256 match manifest.json")
    return EXIT_OK


def summary(m: Manifest) -> str:
    tok = m.tokenizer
    lines = [
        f"tokenizer {tok.spec} (vocab {tok.vocab_size}, eos {tok.eos_id}, bos {tok.bos_id})",
        f"dtype     {m.dtype}",
        f"sources   {len(m.sources)} files, {m.documents:,} documents, {m.total_tokens:,} tokens",
    ]
    for name in ("train", "val"):
        s = m.split(name)
        lines.append(
            f"{name:<9} {s.documents:,} documents, {s.tokens:,} tokens ({s.trained:,} trained) in "
            f"{len(s.shards)} shards"
        )
    mixed = [s for s in m.sources if "weight" in s]
    if mixed:
        lines.append(
            "mix       "
            + ", ".join(f"{s['path']}:{s['weight']:g} ({s['documents']:,} documents)" for s in mixed)
        )
    rows = m.rows
    if rows.get("train_on"):
        lines.append(
            f"chat      template {rows['template'] or 'none (completion rows)'}, trained on {rows['train_on']}"
            f"{'' if rows['train_on'] == 'all' else ' turns'}"
        )
    if rows.get("max_len") is not None:
        lines.append(
            f"max-len   {rows['max_len']} tokens: {rows['dropped']:,} documents dropped, "
            f"{rows['truncated']:,} truncated (--overlong {rows['overlong']})"
        )
    return "\n".join(lines)
