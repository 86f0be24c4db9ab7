"""``seektrain data show DIR``: one prepared document as the trainer will see it.

Token ids, the loss mask and the decoded text with the trained spans marked (ANSI colour on a terminal,
``⟦…⟧`` otherwise), so a user can check the template and mask before spending GPU hours on them.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from seektrain.data.dataset import TokenDataset
from seektrain.data.tokenizer import load_tokenizer
from seektrain.errors import UserError
from seektrain.exit_codes import EXIT_OK

_ANSI = ("\x1b[1;32m", "\x1b[0m")
_BRACKETS = ("⟦", "⟧")


def run_show(args: argparse.Namespace) -> int:
    tokens, mask, count = read_document(args.dir, args.split, args.index)
    if args.json:
        print(json.dumps({"tokens": tokens.tolist(), "loss_mask": mask.tolist()}))
        return EXIT_OK
    dataset_spec = TokenDataset(args.dir, args.split).manifest.tokenizer.spec
    tokenizer = load_tokenizer(dataset_spec)
    marks = _ANSI if sys.stdout.isatty() else _BRACKETS
    print(
        f"document  {args.index} of {count} ({args.split}): {tokens.size} tokens, {int(mask.sum())} trained"
    )
    print(f"tokens    {tokens.tolist()}")
    print(f"loss_mask {mask.tolist()}")
    print(f"text      (trained spans {'in green' if marks is _ANSI else 'in ⟦ ⟧'}):")
    print(marked_text(tokenizer.decode, tokens, mask, marks))
    return EXIT_OK


def read_document(directory: str, split: str, index: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, loss mask, documents in the split) of document ``index``; ValueError when out of range."""
    dataset = TokenDataset(directory, split)
    ends = dataset.document_ends()
    if index >= len(ends):
        raise UserError(
            f"--index {index}: split {split!r} of {directory} has {len(ends)} documents; "
            f"pass 0..{len(ends) - 1}"
        )
    start = int(ends[index - 1]) if index else 0
    length = int(ends[index]) - start
    tokens = np.asarray(dataset.read(start, length), dtype=np.int64)
    return tokens, np.asarray(dataset.read_mask(start, length), dtype=np.int64), len(ends)


def marked_text(decode, tokens: np.ndarray, mask: np.ndarray, marks: tuple[str, str]) -> str:
    """The text, each run of trained tokens decoded on its own and wrapped in ``marks``."""
    pieces = []
    edges = np.flatnonzero(np.diff(mask)) + 1
    for run in np.split(np.arange(tokens.size), edges):
        if run.size:
            text = decode(tokens[run].tolist())
            pieces.append(f"{marks[0]}{text}{marks[1]}" if mask[run[0]] else text)
    return "".join(pieces)
