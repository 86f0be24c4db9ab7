"""`seektrain models`: the model presets with their total and activated parameter counts."""

from __future__ import annotations

import argparse
import json

from seektrain.exit_codes import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list model presets with parameter counts")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(handler=run)


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def run(args: argparse.Namespace) -> int:
    from seektrain.models import PRESETS, count_params, get_preset  # torch: here, not in `seektrain --help`

    rows = []
    for name in PRESETS:
        cfg = get_preset(name)
        counts = count_params(cfg)
        rows.append(
            {
                "name": name,
                "arch": cfg.arch,
                "total_params": counts.total,
                "active_params": counts.active,
                "mtp_params": counts.mtp,
                "layers": cfg.num_hidden_layers,
                "hidden_size": cfg.hidden_size,
                "experts": cfg.n_routed_experts,
                "experts_per_token": cfg.num_experts_per_tok,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    header = (
        f"{'preset':<18} {'arch':<12} {'layers':>6} {'hidden':>6} {'experts':>9} "
        f"{'total':>9} {'active':>9} {'mtp':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        experts = f"{r['experts_per_token']}/{r['experts']}" if r["experts"] else "-"
        print(
            f"{r['name']:<18} {r['arch']:<12} {r['layers']:>6} {r['hidden_size']:>6} {experts:>9} "
            f"{_human(r['total_params']):>9} {_human(r['active_params']):>9} {_human(r['mtp_params']):>8}"
        )
    print(
        "\ntotal and active exclude MTP modules; active also excludes the input embedding table "
        "(the convention of the published sizes)"
    )
    return EXIT_OK
