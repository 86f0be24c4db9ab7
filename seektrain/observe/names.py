"""The one place where metric keys become Prometheus names and TensorBoard tags.

The trainer logs flat keys (``loss``, ``tokens_per_s``, ``mem_peak_gib``); every exporter derives its own
name from the key here, so the Grafana dashboard, the alert rules, the docs and the tests can all be
checked against ``EXPORTED_METRICS`` instead of against each other.
"""

from __future__ import annotations

import re

PREFIX = "seektrain_"

# Keys whose Prometheus name follows the Prometheus naming guide rather than the short log key.
RENAMES: dict[str, str] = {"tokens_per_s": "tokens_per_second", "lr": "learning_rate"}

# The keys the trainer and the observe helpers log, with the help text of their gauge.
STANDARD_KEYS: dict[str, str] = {
    "step": "Optimizer steps completed.",
    "loss": "Training loss (next-token cross-entropy) of the last step.",
    "mtp_loss": "Multi-token-prediction loss of the last step.",
    "val_loss": "Validation loss (next-token cross-entropy on the val split) at the last evaluation.",
    "aux_loss": "MoE balance loss of the last step.",
    "lr": "Learning rate of the last step.",
    "grad_norm": "Global gradient norm before clipping.",
    "loss_scale": "Dynamic loss scale (fp16 only).",
    "tokens_per_s": "Training tokens per second, all ranks together.",
    "tokens_seen": "Training tokens consumed since the run began.",
    "mfu": "Model FLOPs utilisation, a fraction of the hardware peak (0..1).",
    "step_time_s": "Wall time of the last step.",
    "data_wait_s": "Time the last step waited for its batch.",
    "fwd_bwd_s": "Time of forward and backward passes in the last step.",
    "optim_s": "Time of the optimizer update in the last step.",
    "comm_s": "Time of explicit (non-overlapped) communication in the last step.",
    "checkpoint_stall_s": (
        "Time the training thread spent saving or committing a checkpoint after the last step that did."
    ),
    "mem_allocated_gib": "CUDA memory held by tensors.",
    "mem_reserved_gib": "CUDA memory held by the caching allocator.",
    "mem_peak_gib": "Peak CUDA memory held by tensors since the run began.",
    "mem_rss_gib": "Resident memory of the process (CPU runs).",
    "mem_peak_rss_gib": "Peak resident memory of the process (CPU runs).",
    "expert_imbalance": "MoE load imbalance: max over mean tokens per expert (1 = balanced).",
    "gpu_util_pct": "GPU utilisation reported by NVML, percent.",
    "gpu_mem_used_gib": "GPU memory in use reported by NVML (all processes).",
    "gpu_power_w": "GPU power draw reported by NVML, watts.",
    "gpu_temp_c": "GPU temperature reported by NVML, degrees Celsius.",
}

# Per-layer MoE health (seektrain.train.balance.layer_metrics): logged as ``KEY/layerN`` (N the decoder
# layer's index), exported to Prometheus as one gauge per key with a ``layer`` label.
LAYER_KEYS: dict[str, str] = {
    "moe_load_max_over_mean": "Tokens of the busiest expert over the mean per expert, per MoE layer (1 = balanced).",
    "moe_top_expert_share": (
        "Share of a MoE layer's routed token slots that went to its busiest expert (1/top_k = collapsed)."
    ),
    "moe_router_entropy": (
        "Mean entropy (nats) of a MoE layer's routing scores per token, normalised to sum to 1 "
        "(log(experts) = uniform)."
    ),
    "moe_bias_spread": "Max minus min of a MoE layer's V3 balancing bias (e_score_correction_bias).",
}
_LAYER_KEY = re.compile(r"^(\w+)/layer(\d+)$")


def layer_key(key: str, layer: int) -> str:
    """``moe_router_entropy``, 3 -> ``moe_router_entropy/layer3``: the key a per-layer value is logged under."""
    return f"{key}/layer{layer}"


def split_layer_key(key: str) -> tuple[str, str] | None:
    """``moe_router_entropy/layer3`` -> (``moe_router_entropy``, ``3``); None for any other key."""
    match = _LAYER_KEY.match(key)
    return (match.group(1), match.group(2)) if match and match.group(1) in LAYER_KEYS else None


RUN_INFO = PREFIX + "run"  # an Info metric: exported as seektrain_run_info{run=..,model=..,world_size=..}

_BAD = re.compile(r"[^a-zA-Z0-9_]+")


def metric_name(key: str) -> str:
    """``tokens_per_s`` -> ``seektrain_tokens_per_second``; ``train/loss`` -> ``seektrain_train_loss``."""
    base = RENAMES.get(key, key)
    clean = _BAD.sub("_", base).strip("_") or "unnamed"
    return PREFIX + clean


def tb_tag(key: str) -> str:
    """A TensorBoard tag that groups related scalars into one section (``train/loss``, ``time/optim_s``)."""
    if "/" in key:
        return key
    if key.startswith("mem_"):
        group = "memory"
    elif key.startswith("gpu_"):
        group = "gpu"
    elif key.endswith("_s") and key not in ("tokens_per_s",):
        group = "time"
    elif key in ("tokens_per_s", "tokens_seen", "mfu"):
        group = "perf"
    elif key.startswith("expert_") or key == "aux_loss":
        group = "moe"
    else:
        group = "train"
    return f"{group}/{key}"


# Every name a sink exports when the standard keys are logged. Dashboards and alerts may use only these.
EXPORTED_METRICS: frozenset[str] = frozenset(
    {metric_name(k) for k in (*STANDARD_KEYS, *LAYER_KEYS)} | {RUN_INFO + "_info"}
)
