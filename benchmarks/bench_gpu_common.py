"""What the rows of bench_gpu.py share: their names, the issue-14 targets, device timing and memory
helpers, and ``Results``, which holds every figure and rewrites the JSON file after each row."""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the checkout these scripts belong to
MODELS = ("dense", "moe")
MODEL_ROWS = ("eager", "compiled", "transformers", "trainer_bf16", "trainer_fp8", "ring")
CHECKPOINT_ROWS = ("ckpt_sync", "ckpt_async")
ROWS = MODEL_ROWS + CHECKPOINT_ROWS
TITLES = {
    "eager": "ours fwd+bwd, eager",
    "compiled": "ours fwd+bwd, regional compile",
    "transformers": "transformers fwd+bwd (sdpa)",
    "trainer_bf16": "trainer step, bf16 (AdamW, fp32 master)",
    "trainer_fp8": "trainer step, precision.fp8=rowwise",
    "ring": "ring attention (cp, one rank) vs plain, attention only",
    "ckpt_sync": "checkpoint save, synchronous",
    "ckpt_async": "checkpoint save, async",
}
NOT_SELECTED = "not selected (--rows)"
TARGETS = {
    "mfu_dense": 0.50,
    "mfu_moe": 0.35,
    "vs_transformers": 1.3,
    "fp8_vs_bf16": 1.3,
    "ckpt_stall_s": 1.0,
}


# ----------------------------------------------------------------------------- device helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_gib(device: torch.device) -> float:
    """CUDA: ``max_memory_allocated`` since the row began. CPU: the process's peak resident memory so far
    (not per row: the CPU has no resettable peak)."""
    from seektrain.observe.memory_stats import memory_stats

    stats = memory_stats(device)
    return stats.get("mem_peak_gib", stats.get("mem_peak_rss_gib"))


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- results
class Results:
    """Every figure of the run; the JSON file is rewritten after each row, so a run stopped by a time
    limit still leaves what it measured."""

    def __init__(self, out: Path | None, head: dict):
        self.out, self.data = out, {**head, "models": {}, "rows": {m: {} for m in MODELS}}
        self.t0 = time.perf_counter()

    def model(self, key: str, facts: dict) -> None:
        self.data["models"][key] = facts
        self.write()

    def row(self, model: str, row: str, result: dict) -> dict:
        result = {"title": TITLES[row], **result}
        self.data["rows"][model][row] = result
        self.data["wall_s"] = time.perf_counter() - self.t0
        self.write()
        print(f"[{self.data['wall_s']:6.1f} s] {model:5s} {TITLES[row]}: {describe(result)}", flush=True)
        return result

    def write(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            os.replace(tmp, self.out)


def describe(r: dict) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    if r.get("error"):
        return f"ERROR: {r['error']}"
    parts = []
    if r.get("tokens_per_s") is not None:
        parts.append(f"{r['tokens_per_s']:,.0f} tokens/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r.get("peak_mem_gib") is not None:
        parts.append(f"peak {r['peak_mem_gib']:.1f} GiB")
    if r.get("compile_s") is not None:
        parts.append(f"compile {r['compile_s']:.1f} s")
    if r.get("stall_s") is not None:
        parts.append(f"stall {r['stall_s']:.2f} s")
    if r.get("background_s") is not None:
        parts.append(f"then {r['background_s']:.2f} s in the background")
    return ", ".join(parts) + f" ({r.get('row_wall_s', 0):.1f} s)"


def run_row(results: Results, model: str, row: str, selected: set[str], fn, device: torch.device) -> dict:
    """Run one row: ``fn()`` returns its figures; an exception becomes the row's error and the next row
    runs (after freeing memory)."""
    if row not in selected:
        return results.row(model, row, {"skipped": NOT_SELECTED})
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as err:
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]}
    free_memory(device)
    return results.row(model, row, {**result, "row_wall_s": time.perf_counter() - t0})
