"""`seektrain sample`: continue a prompt with the newest checkpoint of a run."""

from __future__ import annotations

import argparse
from pathlib import Path

from seektrain.cli.arg_types import SEED, float_in, int_in
from seektrain.exit_codes import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a trained run")
    p.add_argument("--run", required=True, help="the run.dir of a training run")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int_in(0), default=200, help="tokens to generate (>= 0)")
    p.add_argument(
        "--temperature", type=float_in(0), default=0.8, help="sampling temperature (>= 0; 0 = greedy)"
    )
    p.add_argument(
        "--top-k", type=int_in(0), default=40, help="sample among the k likeliest tokens (0 = all)"
    )
    p.add_argument("--seed", type=SEED, default=0)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from seektrain.train.generate import generate, load_run_model

    model, tokenizer, path = load_run_model(Path(args.run))
    # an empty prompt starts after a document boundary, as every training document does
    ids = tokenizer.encode(args.prompt) or [
        tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    ]
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(f"# {path}")
    print(args.prompt + tokenizer.decode(out))
    return EXIT_OK
