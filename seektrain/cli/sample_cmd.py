"""`seektrain sample`: continue a prompt with the newest checkpoint of a run."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a trained run")
    p.add_argument("--run", required=True, help="the run.dir of a training run")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from seektrain.train.generate import generate, load_run_model

    model, tokenizer, path = load_run_model(Path(args.run))
    ids = tokenizer.encode(args.prompt)
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(f"# {path}")
    print(args.prompt + tokenizer.decode(out))
    return 0
