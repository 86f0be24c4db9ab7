"""Versions (torch, CUDA, NCCL, driver) and whether they fit together; GPUs, their memory, and how
they are connected (``nvidia-smi topo -m``).

What is a blocker: GPUs that the driver sees but torch cannot use (a CUDA build newer than the driver, a
CPU-only torch on a GPU node), or a CUDA torch without NCCL. A machine without GPUs is not broken: it
trains on the CPU with gloo, which the doctor reports as a fact.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import torch
import torch.distributed as dist

from seektrain.doctor.check_report import Check

GIB = 2**30


def _nvidia_smi(*args: str) -> str | None:
    """Output of ``nvidia-smi ARGS``, or None where it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _version(text: str | None) -> tuple[int, ...] | None:
    match = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def driver_info() -> tuple[str | None, tuple[int, ...] | None, list[str]]:
    """(driver version, the CUDA version the driver supports, one line per GPU) from nvidia-smi."""
    rows = _nvidia_smi("--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader")
    header = _nvidia_smi() or ""
    cuda = _version(m.group(1)) if (m := re.search(r"CUDA Version:\s*([\d.]+)", header)) else None
    gpus = [r.strip() for r in (rows or "").splitlines() if r.strip()]
    driver = gpus[0].rsplit(",", 1)[-1].strip() if gpus else None
    return driver, cuda, gpus


def version_checks() -> list[Check]:
    torch_cuda = torch.version.cuda
    driver, driver_cuda, smi_gpus = driver_info()
    checks = [
        Check("ok", "torch", f"{torch.__version__} (built for CUDA {torch_cuda or 'none: CPU-only build'})")
    ]
    if driver:
        checks.append(
            Check(
                "ok",
                "driver",
                f"NVIDIA {driver}, supports CUDA up to "
                f"{'.'.join(map(str, driver_cuda)) if driver_cuda else 'unknown'}",
            )
        )
    want = _version(torch_cuda)
    if smi_gpus and want is None:
        checks.append(
            Check(
                "blocker",
                "cuda",
                f"{len(smi_gpus)} GPU(s) present but torch is a CPU-only build; "
                "install a CUDA build of torch",
            )
        )
    elif smi_gpus and driver_cuda and want and driver_cuda[0] < want[0]:
        checks.append(
            Check(
                "blocker",
                "cuda",
                f"torch needs CUDA {torch_cuda} but the driver supports only "
                f"{'.'.join(map(str, driver_cuda))}: upgrade the driver or install "
                "a torch built for an older CUDA",
            )
        )
    elif smi_gpus and driver_cuda and want and driver_cuda < want:
        checks.append(
            Check(
                "warn",
                "cuda",
                f"torch's CUDA {torch_cuda} is newer than the driver's "
                f"{'.'.join(map(str, driver_cuda))}: runs by minor-version "
                "compatibility, but kernels needing newer PTX fail; upgrade the driver",
            )
        )
    elif smi_gpus and not torch.cuda.is_available():
        checks.append(
            Check(
                "blocker",
                "cuda",
                f"nvidia-smi lists {len(smi_gpus)} GPU(s) but torch cannot use them "
                "(torch.cuda.is_available() is False): check CUDA_VISIBLE_DEVICES "
                "and the driver installation",
            )
        )
    elif want:
        checks.append(Check("ok", "cuda", f"CUDA {torch_cuda} usable: {torch.cuda.is_available()}"))
    if torch.cuda.is_available():
        if dist.is_nccl_available():
            raw = torch.cuda.nccl.version()  # a tuple; an int (e.g. 21803) in older torch
            nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
            checks.append(Check("ok", "nccl", f"NCCL {nccl} (bundled with torch)"))
        else:
            checks.append(
                Check(
                    "blocker",
                    "nccl",
                    "torch has CUDA but no NCCL: multi-GPU training cannot run; "
                    "install an official CUDA build of torch",
                )
            )
    gloo = dist.is_gloo_available()
    checks.append(
        Check(
            "ok" if gloo else "warn",
            "gloo",
            "available (CPU collectives, object collectives)" if gloo else "not built into this torch",
        )
    )
    return checks


def gpu_checks() -> list[Check]:
    if not torch.cuda.is_available():
        return [
            Check(
                "info",
                "gpus",
                "none usable: training runs on the CPU with gloo (not a blocker on a CPU machine)",
            )
        ]
    checks = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        status, note = "ok", ""
        if free < 0.9 * total:
            status, note = "warn", f"; {(total - free) / GIB:.1f} GiB already taken by another process"
        checks.append(
            Check(
                status,
                f"gpu{i}",
                f"{props.name}, {total / GIB:.1f} GiB, compute capability {props.major}.{props.minor}{note}",
            )
        )
    checks.append(topology_check(torch.cuda.device_count()))
    return checks


def topology_check(n_gpus: int) -> Check:
    """``nvidia-smi topo -m``: NV# is NVLink; PIX/PXB/PHB/NODE/SYS go over PCIe (and the CPU)."""
    text = _nvidia_smi("topo", "-m")
    if text is None:
        return Check("info", "topology", "nvidia-smi topo -m not available")
    gpu_rows = [line.split() for line in text.splitlines() if re.match(r"^GPU\d+\s", line)]
    links = {cell for row in gpu_rows for cell in row[1 : n_gpus + 1] if cell != "X"}
    nvlink = any(cell.startswith("NV") for cell in links)
    if n_gpus > 1 and not nvlink:
        return Check(
            "warn",
            "topology",
            "no NVLink between the GPUs (" + ", ".join(sorted(links)) + "): tensor "
            "and expert parallelism within the node run at PCIe speed\n" + text.rstrip(),
        )
    return Check("ok", "topology", ("NVLink" if nvlink else "one GPU") + "\n" + text.rstrip())
