"""Memory and GPU-health numbers for the metrics stream; every function returns {} rather than fail.

Observability must never take a run down: a missing NVML library, a driver hiccup or a non-Linux
``/proc`` only means fewer keys in the dict.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys

import torch

GIB = float(1 << 30)


def _rss_bytes() -> int | None:
    """Current resident set size, from /proc (Linux) — resource only knows the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process: Linux's ``VmHWM``, since ``ru_maxrss`` survives
    ``execve`` (a worker started by a large parent would report the parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """CUDA: ``mem_allocated_gib``, ``mem_reserved_gib``, ``mem_peak_gib`` (of this process on ``device``).
    Elsewhere: ``mem_rss_gib`` and ``mem_peak_rss_gib`` of the process."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        try:
            return {
                "mem_allocated_gib": torch.cuda.memory_allocated(dev) / GIB,
                "mem_reserved_gib": torch.cuda.memory_reserved(dev) / GIB,
                "mem_peak_gib": torch.cuda.max_memory_allocated(dev) / GIB,
            }
        except RuntimeError:
            return {}
    out = {"mem_peak_rss_gib": _peak_rss_bytes() / GIB}
    rss = _rss_bytes()
    if rss is not None:
        out["mem_rss_gib"] = rss / GIB
    return out


def _nvml_read(pynvml, handle) -> dict[str, float]:
    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    out = {"gpu_util_pct": float(util.gpu), "gpu_mem_used_gib": mem.used / GIB}
    try:
        out["gpu_power_w"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        out["gpu_temp_c"] = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    except pynvml.NVMLError:
        pass  # some boards (and MIG slices) do not report power or temperature
    return out


def _smi_stats(index: int) -> dict[str, float]:
    query = "utilization.gpu,memory.used,power.draw,temperature.gpu"
    out = subprocess.run(
        ["nvidia-smi", f"--id={index}", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=5,
        check=True,
    ).stdout
    values = [v.strip() for v in out.strip().splitlines()[0].split(",")]
    keys = ("gpu_util_pct", "gpu_mem_used_gib", "gpu_power_w", "gpu_temp_c")
    stats: dict[str, float] = {}
    for key, raw in zip(keys, values):
        try:
            stats[key] = float(raw) / 1024.0 if key == "gpu_mem_used_gib" else float(raw)  # MiB -> GiB
        except ValueError:
            pass  # "[N/A]"
    return stats


class GpuStats:
    """Utilisation, memory in use, power and temperature of one GPU, for a whole run: NVML (the
    ``nvidia-ml-py`` package's ``pynvml``) is started once, not on every sample; where it cannot start,
    ``nvidia-smi`` (a subprocess per sample); {} if neither. NVML reads only the driver's counters and
    never waits for the device, but each sample still costs host time: the trainer takes one every
    ``metrics.gpu_stats_interval`` steps. ``close()`` shuts NVML down."""

    def __init__(self, index: int | None = None):
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self.index = index
        self._nvml = self._handle = None
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # ImportError, NVMLError, anything from a broken driver: observability never fails
            self.close()
        self._smi = self._nvml is None and shutil.which("nvidia-smi") is not None

    def sample(self) -> dict[str, float]:
        try:
            if self._nvml is not None:
                return _nvml_read(self._nvml, self._handle)
            if self._smi:
                return _smi_stats(self.index)
        except Exception:
            pass
        return {}

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml = self._handle = None


def gpu_stats(index: int | None = None) -> dict[str, float]:
    """One sample of ``GpuStats`` (NVML started and shut down around it); {} without NVML or nvidia-smi."""
    stats = GpuStats(index)
    try:
        return stats.sample()
    finally:
        stats.close()
