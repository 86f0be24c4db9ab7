"""`seektrain flops`: per-module FLOPs and parameters of one training step of the configured model
(forward + backward, like DeepSpeed's FlopsProfiler), next to the analytic count MFU uses."""

from __future__ import annotations

import argparse

from seektrain.cli.arg_types import int_in
from seektrain.cli.config_args import add_config_args
from seektrain.exit_codes import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flops", help="per-module FLOPs and parameter breakdown of one training step")
    add_config_args(p, "TOML config file (default: the built-in run)")
    p.add_argument("--depth", type=int_in(0), default=2, help="module nesting depth to show")
    p.add_argument("--batch", type=int_in(1), default=1, help="sequences in the measured batch")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from seektrain.config.loader import load_config
    from seektrain.models import build_model
    from seektrain.models.job_model import configured_model_config
    from seektrain.observe.flops import model_flops_per_token
    from seektrain.observe.profiler import flops_breakdown, format_flops_table

    cfg = load_config(args.config, args.overrides)
    model_cfg = configured_model_config(cfg)
    seq = cfg.train.seq_len
    model = build_model(model_cfg, seed=cfg.train.seed).train()
    gen = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (args.batch, seq), generator=gen)
    labels = torch.randint(0, model_cfg.vocab_size, (args.batch, seq), generator=gen)
    rows = flops_breakdown(model, tokens, labels)
    print(f"model {model_cfg.name}: one step of {args.batch} × {seq} tokens (forward + backward)")
    print(format_flops_table(rows, depth=args.depth))
    analytic = model_flops_per_token(model_cfg, seq, causal=False) * args.batch * seq
    measured = sum(r.flops for r in rows if r.depth == 0)
    print(
        f"\ncounted {measured:.4g} FLOPs; analytic formula (no causal discount) {analytic:.4g}; "
        f"MFU uses the causal count {model_flops_per_token(model_cfg, seq) * args.batch * seq:.4g}"
    )
    if model_cfg.value_head_dim < model_cfg.qk_head_dim:
        print(
            "(on CPU, MLA attention zero-pads values to the key size to use the flash kernel; the counted "
            "FLOPs include that padding, the analytic ones do not)"
        )
    return EXIT_OK
