"""Observability: metrics to JSONL/TensorBoard/Prometheus, FLOPs and MFU, memory, timing, profiling.

See docs/observability.md for metric names, the MFU formula and how to attach Prometheus and Grafana.
"""

from seektrain.observe.flops import (
    active_matmul_params,
    attention_flops_per_token,
    mfu,
    model_flops_per_token,
    peak_flops,
)
from seektrain.observe.memory_stats import GpuStats, gpu_stats, memory_stats
from seektrain.observe.names import EXPORTED_METRICS, STANDARD_KEYS, metric_name, tb_tag
from seektrain.observe.profiler import FlopsRow, StepProfiler, flops_breakdown, format_flops_table
from seektrain.observe.sink import MetricsSink
from seektrain.observe.summary import format_summary, write_summary

__all__ = [
    "EXPORTED_METRICS",
    "STANDARD_KEYS",
    "FlopsRow",
    "GpuStats",
    "MetricsSink",
    "StepProfiler",
    "active_matmul_params",
    "attention_flops_per_token",
    "flops_breakdown",
    "format_flops_table",
    "format_summary",
    "gpu_stats",
    "memory_stats",
    "metric_name",
    "mfu",
    "model_flops_per_token",
    "peak_flops",
    "tb_tag",
    "write_summary",
]
