"""What ``seektrain plan`` prints: the best layout with its memory breakdown, predicted speed and the
100%-MFU ceiling, the runners-up, and the layout as ``--set`` lines and TOML; or the same as JSON."""

from __future__ import annotations

from seektrain.config.toml_values import set_value, toml_value
from seektrain.observe.flops import model_flops_per_token
from seektrain.plan.search import GIB, Candidate, SearchResult


def throughput(cand: Candidate, world: int, peak_flops_per_device: float) -> dict:
    t = cand.time
    assert t is not None and cand.plan is not None  # a ranked (feasible) candidate
    tokens = cand.plan.tokens_per_step
    return {
        "step_s": t.total_s,
        "tokens_per_s": tokens / t.total_s,
        "samples_per_s": cand.plan.job.train.global_batch_size / t.total_s,
        "mfu": t.model_flops / t.total_s / (peak_flops_per_device * world),
    }


def ceiling(plan, world: int, peak_flops_per_device: float) -> dict:
    """Tokens/s and samples/s if every device ran at 100% of its bf16 peak on model FLOPs only."""
    per_token = model_flops_per_token(plan.model, plan.job.train.seq_len, include_mtp=plan.use_mtp)
    tokens = world * peak_flops_per_device / per_token
    return {
        "flops_per_token": per_token,
        "tokens_per_s": tokens,
        "samples_per_s": tokens / plan.job.train.seq_len,
    }


def set_lines(cand: Candidate) -> str:
    return " ".join(f"--set {k}={set_value(v)}" for k, v in cand.settings.items())


def toml_text(cand: Candidate) -> str:
    sections: dict[str, list[str]] = {}
    for key, value in cand.settings.items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
    return "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items())


def _short(settings: dict) -> str:
    s = settings
    return (
        f"tp={s['parallel.tp']} pp={s['parallel.pp']} dp_replicate={s['parallel.dp_replicate']} "
        f"dp_shard={s['parallel.dp_shard']} cp={s.get('parallel.cp', 1)} ep={s['parallel.ep']} "
        f"micro={s['train.micro_batch_size']} "
        f"ckpt={s['train.activation_checkpoint']}" + (" cpu_offload" if s.get("parallel.cpu_offload") else "")
    )


def to_dict(result: SearchResult, header: dict, top: int) -> dict:
    hw = result.hardware
    peak = hw.bf16_tflops * 1e12
    best = result.ranked[0]
    assert best.plan is not None
    out = dict(header)
    out["hardware"] = {
        "name": hw.name,
        "memory_gib": hw.memory_gib,
        "bf16_tflops": hw.bf16_tflops,
        "fp8_tflops": hw.fp8_tflops,
        "nvlink_gbs": hw.nvlink_gbs,
        "network_gbs": hw.network_gbs,
        "gpus_per_node": hw.gpus_per_node,
        "source": hw.source,
    }
    out["searched"] = len(result.ranked) + len(result.rejected)
    out["feasible"] = len(result.ranked)
    out["ranked"] = []
    for cand in result.ranked[:top]:
        t = cand.time
        assert cand.memory is not None and t is not None  # a ranked (feasible) candidate
        mem = {k: v / GIB for k, v in cand.memory.items().items()}
        out["ranked"].append(
            {
                "settings": cand.settings,
                "memory_gib": mem,
                "host_memory_gib": host_memory(cand, hw),
                "time": {
                    "compute_s": t.compute_s,
                    "fsdp_s": t.fsdp_s,
                    "tp_s": t.tp_s,
                    "ep_s": t.ep_s,
                    "pp_s": t.pp_s,
                    "bubble": t.bubble,
                    "offload_s": t.offload_s,
                    "recompute_s": t.recompute_s,
                    "cp_s": t.cp_s,
                },
                **throughput(cand, result.world_size, peak),
            }
        )
    out["ceiling_100pct_mfu"] = ceiling(best.plan, result.world_size, peak)
    reasons: dict[str, int] = {}
    for cand in result.rejected:
        reason = cand.reason.split(" (needs")[0]  # memory: one group, whatever each layout needs
        reasons[reason] = reasons.get(reason, 0) + 1
    out["rejected"] = [{"reason": r, "layouts": n} for r, n in sorted(reasons.items(), key=lambda x: -x[1])]
    out["set"] = set_lines(best)
    out["toml"] = toml_text(best)
    return out


def host_memory(cand: Candidate, hw) -> dict:
    """Host memory the layout needs besides the processes themselves: per rank (the CPU-offloaded state,
    pinned on a GPU, and the async checkpoint's snapshot buffers) and per node."""
    assert cand.memory is not None
    m = cand.memory
    return {
        "cpu_offload_state": m.host_state / GIB,
        "checkpoint_staging": m.host_staging / GIB,
        "per_rank": m.host_total / GIB,
        "per_node": m.host_total * hw.gpus_per_node / GIB,
        "available_per_node": hw.host_gib * hw.gpus_per_node,
        "initial_weights_per_rank": m.host_load / GIB,
    }


def _host_line(best: dict, hw: dict, lora: bool) -> list[str]:
    host = best["host_memory_gib"]
    load = host["initial_weights_per_rank"]
    lines = []
    if load:
        lines.append(
            f"host memory while loading model.hf_path: {load:.2f} GiB per rank = "
            f"{load * hw['gpus_per_node']:.1f} GiB per node of read buffers (each rank reads only its "
            "own slices, straight into its shards)"
        )
    if not (host["per_rank"] or lora):
        return lines
    if not host["per_rank"]:
        return [
            *lines,
            "host memory: none beyond the processes (no CPU offload, no async checkpoint staging)",
        ]
    parts = [
        f"{label} {host[key]:.1f}"
        for key, label in (
            ("cpu_offload_state", "CPU-offloaded state"),
            ("checkpoint_staging", "checkpoint staging"),
        )
        if host[key]
    ]
    available = f" of {host['available_per_node']:.0f} assumed" if host["available_per_node"] else ""
    return [
        *lines,
        f"host memory: {host['per_rank']:.1f} GiB per rank ({', '.join(parts)}, pinned on a GPU) = "
        f"{host['per_node']:.1f} GiB per node of {hw['gpus_per_node']}{available}",
    ]


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def format_text(data: dict) -> str:
    hw = data["hardware"]
    best = data["ranked"][0]
    ceil = data["ceiling_100pct_mfu"]
    small = best["memory_gib"]["total"] < 1  # tiny models: MiB says more than 0.00 GiB
    unit, scale = ("MiB", 1024) if small else ("GiB", 1)
    fewest = data.get("fewest_gpus")
    lines = [f"fewest devices with a feasible layout: {fewest} × {hw['name']}"] if fewest else []
    lines += [
        f"model {data['model']}: {_count(data['params_total'])} parameters ({_count(data['params_active'])} "
        f"active per token); {data['gpus']} × {hw['name']} ({data['nodes']} node(s) × {hw['gpus_per_node']}); "
        f"seq {data['seq_len']}, global batch {data['global_batch']} sequences ({data['precision']})",
        f"hardware: {hw['memory_gib']:.1f} GiB, bf16 {hw['bf16_tflops']:.4g} TFLOP/s"
        + (f", fp8 {hw['fp8_tflops']:.1f}" if hw["fp8_tflops"] else "")
        + f", NVLink {hw['nvlink_gbs']:.0f} GB/s, network {hw['network_gbs']:.0f} GB/s per device",
        f"  source: {hw['source']}",
        f"searched {data['searched']} layouts: {data['feasible']} feasible",
        "",
        f"best layout: {_short(best['settings'])}",
        f"memory per rank ({unit}):",
    ]
    for item, gib in best["memory_gib"].items():
        lines.append(f"  {item:<44} {gib * scale:9.2f}")
    lines.append(f"  (device memory {hw['memory_gib']:.1f} GiB)")
    lines += _host_line(best, hw, "LoRA" in data["precision"])
    t = best["time"]
    lines += [
        f"predicted step {best['step_s']:.3f} s (compute {t['compute_s']:.3f} s"
        + (f" of which selective recompute {t['recompute_s']:.3f} s" if t.get("recompute_s") else "")
        + f", FSDP/DP traffic {t['fsdp_s']:.3f} s overlapped, TP {t['tp_s']:.3f} s, EP {t['ep_s']:.3f} s, "
        + f"PP p2p {t['pp_s']:.3f} s, "
        + (f"CP ring {t['cp_s']:.3f} s exposed, " if t.get("cp_s") else "")
        + "bubble "
        f"{t['bubble'] * 100:.0f}%"
        + (f", CPU offload {t['offload_s']:.3f} s" if t["offload_s"] else "")
        + ")",
        f"predicted {best['tokens_per_s']:,.0f} tokens/s, {best['samples_per_s']:,.2f} samples/s, "
        f"MFU {best['mfu'] * 100:.1f}%",
        f"ceiling at 100% MFU ({ceil['flops_per_token'] / 1e9:.4g} GFLOP per token): "
        f"{ceil['tokens_per_s']:,.0f} tokens/s = {ceil['samples_per_s']:,.2f} samples/s at most",
    ]
    if len(data["ranked"]) > 1:
        lines += ["", "runners-up:"]
        for cand in data["ranked"][1:]:
            lines.append(
                f"  {_short(cand['settings'])}: step {cand['step_s']:.3f} s, "
                f"{cand['memory_gib']['total']:.1f} GiB, MFU {cand['mfu'] * 100:.1f}%"
            )
    if data["rejected"]:
        lines += ["", "rejected (most common reasons):"]
        for row in data["rejected"][:5]:
            lines.append(f"  {row['layouts']:5d} × {row['reason']}")
    lines += ["", "as --set:", f"  {data['set']}", "", "as TOML:", data["toml"]]
    return "\n".join(lines)
