"""The end-of-run summary: steady-state throughput, MFU, memory, where time went, and advice.

A dashboard shows numbers; a summary should also say when a number is wrong and what usually fixes
it, so a user who never opens Grafana still learns that the data loader is the bottleneck.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

PHASE_KEYS = ("data_wait_s", "fwd_bwd_s", "optim_s", "comm_s")
PEAK_MEMORY_KEYS = ("mem_peak_gib", "mem_reserved_gib", "mem_peak_rss_gib", "gpu_mem_used_gib")
DEFAULT_WARMUP_STEPS = 2  # first steps pay for compilation, allocator growth and cold caches
MFU_FLOOR = 0.10  # below this on a GPU something is usually misconfigured


def _values(records: list[dict], key: str) -> list[float]:
    out = []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append(float(value))
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _loss_scale_halvings(scales: list[float]) -> int:
    return sum(1 for prev, cur in itertools.pairwise(scales) if cur <= prev * 0.5 + 1e-12)


def _advice(summary: dict[str, Any], records: list[dict], steady: list[dict], extra: dict) -> list[str]:
    lines: list[str] = []
    fractions = summary.get("time_fractions", {})
    if fractions.get("data_wait_s", 0.0) > 0.10:
        lines.append(
            f"data wait is {fractions['data_wait_s']:.0%} of step time: the input pipeline is "
            "the bottleneck (raise data workers/prefetch, pre-tokenize, or use faster storage)."
        )
    imbalance = _values(steady, "expert_imbalance")
    if imbalance and max(imbalance) > 1.5:
        lines.append(
            f"expert imbalance reached {max(imbalance):.2f} (max/mean tokens per expert; 1 is "
            "balanced): raise the balance-bias update rate or the aux-loss weight, or check routing."
        )
    scales = _values(records, "loss_scale")
    halvings = _loss_scale_halvings(scales)
    if scales and (min(scales) < 1.0 or halvings > 5):
        lines.append(
            f"the fp16 loss scale collapsed (min {min(scales):g}, halved {halvings} times): "
            "gradients overflow repeatedly; use bf16, lower the learning rate, or clip gradients."
        )
    mfu = summary.get("mfu_mean")
    device = str(extra.get("device", ""))
    if mfu is not None and device.startswith("cuda") and mfu < extra.get("mfu_floor", MFU_FLOOR):
        lines.append(
            f"MFU is only {mfu:.1%}: check that bf16 is on, the micro-batch fills the GPU, "
            "torch.compile is enabled, and the step is not waiting on data or communication."
        )
    losses = [r.get("loss") for r in records if isinstance(r.get("loss"), (int, float))]
    if losses and not math.isfinite(losses[-1]):
        lines.append(
            "the last loss is not finite: lower the learning rate, use bf16, or resume from an "
            "earlier checkpoint."
        )
    return lines


def write_summary(run_dir: Path | str, records: list[dict], extra: dict | None = None) -> dict[str, Any]:
    """Summarize the per-step ``records`` (as logged to metrics.jsonl) into ``run_dir/summary.json``.

    ``extra`` is merged into the summary (model, world size, ...); its ``warmup_steps`` (records
    excluded from the means, default 2), ``device`` and ``mfu_floor`` steer the computation.
    Returns the summary; its ``advice`` list holds a line for each number that looks wrong.
    """
    extra = dict(extra or {})
    skip = int(extra.get("warmup_steps", DEFAULT_WARMUP_STEPS))
    steady = records[skip:] if len(records) > skip else records
    summary: dict[str, Any] = {**extra, "steps": len(records), "steady_steps": len(steady)}
    if records:
        summary["last_step"] = records[-1].get("step")
        losses = _values(records, "loss")
        if losses:
            summary["final_loss"] = losses[-1]
    for key, out in (
        ("tokens_per_s", "tokens_per_s_mean"),
        ("mfu", "mfu_mean"),
        ("step_time_s", "step_time_s_mean"),
    ):
        mean = _mean(_values(steady, key))
        if mean is not None:
            summary[out] = mean
    for key in PEAK_MEMORY_KEYS:
        values = _values(records, key)
        if values:
            summary[f"peak_{key}"] = max(values)

    stalls = _values(records, "checkpoint_stall_s")  # every step that saved or committed a checkpoint
    if stalls:
        summary["checkpoint_stalls"] = len(stalls)
        summary["checkpoint_stall_s_max"] = max(stalls)
        summary["checkpoint_stall_s_total"] = sum(stalls)

    phase_totals = {k: sum(_values(steady, k)) for k in PHASE_KEYS}
    total = sum(_values(steady, "step_time_s")) or sum(phase_totals.values())
    if total > 0:
        fractions = {k: v / total for k, v in phase_totals.items()}
        fractions["other"] = max(0.0, 1.0 - sum(fractions.values()))
        summary["time_fractions"] = fractions
    summary["advice"] = _advice(summary, records, steady, extra)

    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    from seektrain.checkpoint.atomic import write_text_atomic

    write_text_atomic(path / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines for the end of the training log."""
    lines = [
        f"run summary: {summary.get('steps', 0)} steps"
        + (f", final loss {summary['final_loss']:.4f}" if "final_loss" in summary else "")
    ]
    if "tokens_per_s_mean" in summary:
        lines.append(
            f"  throughput   {summary['tokens_per_s_mean']:,.0f} tokens/s "
            f"(mean over {summary.get('steady_steps', 0)} steady steps)"
        )
    if "mfu_mean" in summary:
        lines.append(f"  MFU          {summary['mfu_mean']:.1%}")
    peaks = [(k.removeprefix("peak_"), v) for k, v in summary.items() if k.startswith("peak_")]
    if peaks:
        lines.append("  peak memory  " + ", ".join(f"{k} {v:.2f}" for k, v in peaks))
    if "checkpoint_stall_s_max" in summary:
        lines.append(
            f"  checkpoints  training blocked {summary['checkpoint_stall_s_total']:.2f} s in "
            f"{summary['checkpoint_stalls']} steps, at most {summary['checkpoint_stall_s_max']:.2f} s"
        )
    ran = summary.get("layout_ran")
    if ran:
        lines.append("  layout ran   " + _describe_layout_ran(ran))
    fractions = summary.get("time_fractions")
    if fractions:
        lines.append(
            "  step time    " + ", ".join(f"{k.removesuffix('_s')} {v:.0%}" for k, v in fractions.items())
        )
    for advice in summary.get("advice", []):
        lines.append(f"  advice: {advice}")
    return "\n".join(lines)


def _describe_layout_ran(ran: dict) -> str:
    """One line of ``layout_ran`` (seektrain/parallel/layout_record.py), e.g. ``fsdp (shard 2, replicate 1),
    tp 1, ep 2 (4 experts per rank, 20 all-to-alls per step), pp stages [0]``."""
    text = (
        f"{ran['data_parallel']} (shard {ran['shard_group_size']}, replicate {ran['replicate_group_size']}), "
        f"tp {ran['tp']}, ep {ran['ep']}"
    )
    if "experts_per_rank" in ran:
        text += (
            f" ({ran['experts_per_rank']} experts per rank, "
            f"{ran.get('all_to_all_per_step', 0)} all-to-alls per step)"
        )
    if ran.get("cp", 1) > 1:
        text += f", cp {ran['cp']} ({ran.get('cp_hops_per_step', 0)} ring hops per step)"
    text += f", pp stages {ran['pp_stages']}"
    return text + (f" ({ran['pp_schedule']})" if ran.get("pp_schedule") else "")
