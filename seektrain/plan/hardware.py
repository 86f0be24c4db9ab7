"""The accelerators the planner knows: memory, dense bf16/fp8 peaks, NVLink and network bandwidth, and
where each number comes from.

Conventions, so the numbers compare: ``memory_gib`` is what ``torch.cuda.get_device_properties`` reports
(the "80 GB" of a datasheet is 80 GiB of HBM less what the driver keeps); peaks are dense tensor-core
FLOP/s without 2:4 sparsity; ``nvlink_gbs`` is the datasheet's NVLink total (both directions added), so
one direction is half of it; ``network_gbs`` is one GPU's inter-node NIC in one direction (400 Gb/s
NDR InfiniBand = 50 GB/s); ``memory_gbs`` is the datasheet's device-memory bandwidth (HBM), what
memory-bound work (the recomputation of ``train.activation_checkpoint=selective``) runs at. ``cpu`` is
measured on the machine the planner runs on (``cpu_hardware``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from seektrain.errors import UserError


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float  # usable memory of one device (or one rank's share of the host, for cpu)
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak; 0 = no fp8 tensor cores
    nvlink_gbs: float  # intra-node, total of both directions, per device
    network_gbs: float  # inter-node, one direction, per device
    gpus_per_node: int
    context_gib: float  # CUDA context, cuBLAS/NCCL workspaces: allocated outside PyTorch's tensors
    source: str
    host_gib: float = 0.0  # host memory per device for parallel.cpu_offload (DGX-class node RAM / 8)
    memory_gbs: float = 0.0  # device-memory bandwidth, GB/s (HBM; for cpu one rank's share of a copy's)

    @property
    def intra_bytes_per_s(self) -> float:
        """One direction of the intra-node link, what a ring collective moves per device."""
        return self.nvlink_gbs / 2 * 1e9

    @property
    def inter_bytes_per_s(self) -> float:
        return self.network_gbs * 1e9


_NVIDIA = "https://www.nvidia.com/en-us/data-center/"
GPUS: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100-80g",
            79.1,
            989.4,
            1978.9,
            900.0,
            50.0,
            8,
            1.0,
            _NVIDIA
            + "h100/ (H100 SXM5: 80 GB HBM3 at 3.35 TB/s, bf16 989.4 TFLOPS dense, fp8 1978.9, NVLink 900 GB/s); "
            "network: ConnectX-7 400 Gb/s NDR per GPU (DGX H100); host 2 TB per 8 GPUs (DGX H100)",
            256.0,
            3350.0,
        ),
        Hardware(
            "h200",
            139.8,
            989.4,
            1978.9,
            900.0,
            50.0,
            8,
            1.0,
            _NVIDIA
            + "h200/ (H200 SXM: 141 GB HBM3e at 4.8 TB/s, bf16 989.4 TFLOPS dense, fp8 1978.9, NVLink 900 GB/s); "
            "network: 400 Gb/s NDR per GPU (HGX H200); host 2 TB per 8 GPUs assumed",
            256.0,
            4800.0,
        ),
        Hardware(
            "h800",
            79.1,
            989.4,
            1978.9,
            400.0,
            50.0,
            8,
            1.0,
            _NVIDIA
            + "h800/ (H800 SXM: 80 GB HBM3 at 3.35 TB/s, compute as H100 SXM, NVLink 400 GB/s); DeepSeek-V3 report "
            "https://arxiv.org/abs/2412.19437 sec. 3.2.2: NVLink 160 GB/s achieved, IB 50 GB/s per GPU; host 2 TB per "
            "8 GPUs assumed",
            256.0,
            3350.0,
        ),
        Hardware(
            "a100-80g",
            79.1,
            312.0,
            0.0,
            600.0,
            25.0,
            8,
            1.0,
            _NVIDIA
            + "a100/ (A100 SXM 80GB: HBM2e at 2.039 TB/s, bf16 312 TFLOPS dense, no fp8, NVLink 600 GB/s); "
            "network: 200 Gb/s HDR per GPU (DGX A100); host 2 TB per 8 GPUs (DGX A100 640GB)",
            256.0,
            2039.0,
        ),
        Hardware(
            "a100-40g",
            39.4,
            312.0,
            0.0,
            600.0,
            25.0,
            8,
            1.0,
            _NVIDIA
            + "a100/ (A100 SXM 40GB: HBM2 at 1.555 TB/s, bf16 312 TFLOPS dense, no fp8, NVLink 600 GB/s); "
            "network: 200 Gb/s HDR per GPU (DGX A100); host 1 TB per 8 GPUs (DGX A100 320GB)",
            128.0,
            1555.0,
        ),
    )
}
KNOWN = tuple(GPUS) + ("cpu",)


def _host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


NOMINAL_CPU_TFLOPS = 0.1  # parallel.auto on CPU: every rank must rank layouts alike, so no timing probe
NOMINAL_CPU_MEMORY_GBS = 10.0  # likewise for the host's copy bandwidth (one DDR4/DDR5 channel's order)


def copy_bandwidth(seconds: float = 0.1) -> float:
    """Measured bytes/s (read + written) of copying a 64 MiB fp32 tensor on this host's CPU, at the current
    torch thread count: the memory-bound speed of elementwise work."""
    import time

    import torch

    src = torch.ones(16 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: fault the pages in
    iters, start = 0, time.perf_counter()
    while True:
        dst.copy_(src)
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * src.nbytes * iters / elapsed


def cpu_hardware(ranks_per_node: int, measure: bool = True) -> Hardware:
    """This machine's CPU as ``ranks_per_node`` ranks: each gets an equal share of the host memory and of
    the matmul peak measured here (seektrain.observe.flops probe, bf16, current thread count); gloo over
    loopback is taken as 1 GB/s (an assumption, not measured). ``measure=False`` uses a nominal
    ``NOMINAL_CPU_TFLOPS`` instead, the same on every rank."""
    import torch

    from seektrain.observe.flops import peak_flops

    if measure:
        flops, how = peak_flops("cpu", torch.bfloat16)
        copy = copy_bandwidth()
        how += f", copy {copy / 1e9:.1f} GB/s measured"
    else:
        flops, how = NOMINAL_CPU_TFLOPS * 1e12, f"nominal {NOMINAL_CPU_TFLOPS} TFLOP/s (not measured)"
        copy = NOMINAL_CPU_MEMORY_GBS * 1e9
        how += f", nominal copy {NOMINAL_CPU_MEMORY_GBS:.0f} GB/s"
    share = max(1, ranks_per_node)
    return Hardware(
        "cpu",
        _host_memory_gib() / share,
        flops / 1e12 / share,
        0.0,
        2.0,
        1.0,
        share,
        0.0,
        f"measured on this machine ({os.cpu_count()} cores, {_host_memory_gib():.1f} GiB RAM): "
        f"{how}; loopback gloo bandwidth assumed 1 GB/s",
        memory_gbs=copy / 1e9 / share,
    )


def hardware(name: str, gpus_per_node: int = 8) -> Hardware:
    """The table entry for ``name`` (case-insensitive), or a ValueError listing the known ones."""
    key = name.lower()
    if key == "cpu":
        return cpu_hardware(gpus_per_node)
    if key not in GPUS:
        raise UserError(f"unknown --gpu {name!r}: known are {', '.join(KNOWN)}")
    return replace(GPUS[key], gpus_per_node=gpus_per_node)


def name_from_device(device_name: str) -> str | None:
    """Table name for a ``torch.cuda.get_device_name`` string ("NVIDIA H100 80GB HBM3" -> h100-80g)."""
    upper = device_name.upper()
    if "H200" in upper:
        return "h200"
    if "H800" in upper:
        return "h800"
    if "H100" in upper:
        return "h100-80g"
    if "A100" in upper or "A800" in upper:
        return "a100-40g" if "40G" in upper else "a100-80g"
    return None
