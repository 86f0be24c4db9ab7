"""The markdown report of bench_gpu.py: the rows side by side for the two models, then the ratios the
issue-14 targets are stated in. Only measured figures are printed; a skipped or failed row says why."""

from __future__ import annotations

from bench_gpu_common import MODEL_ROWS, MODELS, NOT_SELECTED, TARGETS, TITLES


def _ok(row: dict | None) -> bool:
    return (
        bool(row) and not row.get("skipped") and not row.get("error") and row.get("tokens_per_s") is not None
    )


def _ratio(rows: dict, num: str, den: str) -> float | None:
    a, b = rows.get(num), rows.get(den)
    return a["tokens_per_s"] / b["tokens_per_s"] if _ok(a) and _ok(b) else None


def comparisons(data: dict) -> dict:
    """The figures the targets speak of, per model (None where a row is missing)."""
    out = {}
    for key in MODELS:
        rows = data["rows"].get(key, {})
        if not rows:
            continue
        out[key] = {
            "compiled_vs_transformers": _ratio(rows, "compiled", "transformers"),
            "eager_vs_transformers": _ratio(rows, "eager", "transformers"),
            "trainer_vs_eager": _ratio(rows, "trainer_bf16", "eager"),
            "fp8_vs_bf16": _ratio(rows, "trainer_fp8", "trainer_bf16"),
            "mfu_compiled": rows["compiled"]["mfu"] if _ok(rows.get("compiled")) else None,
            "mfu_trainer_bf16": rows["trainer_bf16"]["mfu"] if _ok(rows.get("trainer_bf16")) else None,
            "mfu_target": TARGETS["mfu_dense" if key == "dense" else "mfu_moe"],
            # bf16 loss of batch 0 in both models: the on-device check that they compute the same thing
            "first_loss_ours": rows["eager"].get("first_loss") if _ok(rows.get("eager")) else None,
            "first_loss_transformers": rows["transformers"].get("first_loss")
            if _ok(rows.get("transformers"))
            else None,
        }
    dense = data["rows"].get("dense", {})
    for row in ("ckpt_sync", "ckpt_async"):
        if dense.get(row) and dense[row].get("stall_s") is not None:
            out.setdefault("checkpoint", {})[f"{row[5:]}_stall_s"] = dense[row]["stall_s"]
    return out


def _cells(row: dict | None, notes: list[str]) -> list[str]:
    if not row:
        return ["—", "", ""]
    if row.get("skipped") == NOT_SELECTED:
        return ["not run", "", ""]
    why = row.get("skipped") or row.get("error")
    if why:
        notes.append(("skipped: " if row.get("skipped") else "ERROR: ") + why)
        return [f"{'skipped' if row.get('skipped') else 'error'} [{len(notes)}]", "", ""]
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
    mem = f"{row['peak_mem_gib']:.1f}" if row.get("peak_mem_gib") is not None else "n/a"
    return [f"{row['tokens_per_s']:,.0f}", mfu, mem]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def print_report(data: dict) -> None:
    models, notes = data["models"], []
    dev, s = data["device"], data["settings"]
    peak = dev.get("peak_bf16_flops")
    print()
    print(
        f"## GPU benchmark: {dev['name']}"
        + (" (SMOKE RUN ON A CPU: not GPU figures)" if data["smoke"] else "")
    )
    print()
    print(
        f"{s['batch']} x {s['seq']} tokens per step, bf16, median of {s['iters']} timed steps after "
        f"{s['warmup']} warm-up; MFU against the dense bf16 peak "
        + (f"{peak / 1e12:.1f} TFLOP/s ({dev['hardware']})" if peak else "(unknown: no MFU)")
        + f"; torch {data['versions']['torch']}, transformers {data['versions']['transformers']}, "
        f"torchao {data['versions']['torchao']}; commit {data['commit']['sha']}; {data.get('wall_s', 0):.0f} s in all"
    )
    if data.get("interrupted"):
        print(f"\nINTERRUPTED ({data['interrupted']}): rows not reached are missing.")
    print()
    header = ["row"]
    for key in MODELS:
        if key in models:
            name = f"{key} {_count(models[key]['params_total'])}"
            header += [f"{name} tokens/s", "MFU", "peak GiB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in MODEL_ROWS:
        cells = [TITLES[row]]
        for key in MODELS:
            if key in models:
                cells += _cells(data["rows"].get(key, {}).get(row), notes)
        print("| " + " | ".join(cells) + " |")

    comp = comparisons(data)
    data["comparisons"] = comp
    print()
    print("| figure | " + " | ".join(k for k in MODELS if k in comp) + " | target |")
    print("|---|" + "---|" * len([k for k in MODELS if k in comp]) + "---|")
    lines = [
        (
            "ours compiled / transformers (tokens/s)",
            "compiled_vs_transformers",
            ".2f",
            f"≥ {TARGETS['vs_transformers']}x",
        ),
        ("ours eager / transformers", "eager_vs_transformers", ".2f", ""),
        ("trainer bf16 / ours eager (optimizer step included)", "trainer_vs_eager", ".2f", ""),
        ("trainer fp8 / trainer bf16", "fp8_vs_bf16", ".2f", f"≥ {TARGETS['fp8_vs_bf16']}x"),
        (
            "MFU, ours compiled",
            "mfu_compiled",
            ".1%",
            f"dense ≥ {TARGETS['mfu_dense']:.0%}, MoE ≥ {TARGETS['mfu_moe']:.0%}",
        ),
        ("MFU, trainer bf16", "mfu_trainer_bf16", ".1%", ""),
        ("first-step loss, ours eager", "first_loss_ours", ".4f", "equal (same weights, same batch)"),
        ("first-step loss, transformers", "first_loss_transformers", ".4f", ""),
    ]
    for title, field, spec, target in lines:
        cells = [_fmt(comp[k][field], spec) for k in MODELS if k in comp]
        print(f"| {title} | " + " | ".join(cells) + f" | {target} |")
    for key in MODELS:
        compiled = data["rows"].get(key, {}).get("compiled")
        if _ok(compiled):
            print(
                f"\n{key}: regional compile took {compiled['compile_s']:.1f} s (first fwd+bwd, compilation included)"
            )

    dense = data["rows"].get("dense", {})
    if any(dense.get(r) and dense[r].get("skipped") != NOT_SELECTED for r in ("ckpt_sync", "ckpt_async")):
        print()
        print(
            "| checkpoint of the dense model (fp32 weights + AdamW) | stall s | first save's stall s "
            "| background s | GB written | target |"
        )
        print("|---|---|---|---|---|---|")
        for row in ("ckpt_sync", "ckpt_async"):
            r = dense.get(row)
            if not r:
                continue
            why = r.get("skipped") or r.get("error")
            if why == NOT_SELECTED:
                continue
            if why:
                notes.append(("skipped: " if r.get("skipped") else "ERROR: ") + why)
                print(
                    f"| {TITLES[row]} | {'skipped' if r.get('skipped') else 'error'} [{len(notes)}] | | | | |"
                )
                continue
            print(
                f"| {TITLES[row]} | {r['stall_s']:.2f} | {_fmt(r.get('first_stall_s'), '.2f')} | "
                f"{_fmt(r.get('background_s'), '.2f')} | {r['bytes_written'] / 1e9:.2f} | "
                f"stall ≤ {TARGETS['ckpt_stall_s']:.0f} s |"
            )
    if notes:
        print()
        for i, note in enumerate(notes, 1):
            print(f"[{i}] {note}")
