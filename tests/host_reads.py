"""Count the host reads of tensor values (``item``, ``tolist``, ``float()``, ``int()``, ``bool()``, use as
an index, ``numpy``) made on each step of a tiny training run in this process, and print them as JSON.

On a GPU each such read waits for the device to finish everything queued before it; the trainer keeps
per-step values on the device and reads them only at flush steps (``run.log_interval``, the first and
last step, checkpoint and evaluation steps). ``tests/test_host_syncs.py`` runs this in a subprocess (the
run initialises a process group) and checks that no other step reads anything.

The run uses the generic platform policy, the one a GPU gets: the CPU policy's padded kernels may read
counts on the host, which costs nothing on a CPU. Reads inside torch's C++ (a CUDA ``bincount`` sizing
its output, a blocking copy) are invisible to the Python hooks; on a machine with CUDA the run also sets
``torch.cuda.set_sync_debug_mode("warn")`` and counts each synchronising operation it reports.

    python tests/host_reads.py RUN_DIR --set model.preset=tiny-dense ...
    -> {"reads": {"STEP": ["item at seektrain/train/step.py:97 train_step", ...]}}
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy")
PACKAGE = str(Path(__file__).resolve().parents[1] / "seektrain")


def _caller() -> str:
    """The innermost seektrain frame of the current stack (where the read was asked for), or the
    innermost frame outside this file."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__]
    ours = [f for f in frames if f.filename.startswith(PACKAGE)]
    f = (ours or frames)[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _gpu_policy_class():
    from dataclasses import replace

    from seektrain.models.kernels import Kernels
    from seektrain.platform.policy import PlatformPolicy

    class GpuPolicy(PlatformPolicy):
        """The generic policy as an SM 9.0+ GPU has it: the experts run as one grouped GEMM (which this
        CPU runs in fp32 too), not the batched matmul that sizes its padding on the host."""

        def model_kernels(self) -> Kernels:
            plain = Kernels()
            return replace(super().model_kernels(), grouped_mm_dtypes=plain.grouped_mm_dtypes,
                           grouped_mm_dim_multiple=plain.grouped_mm_dim_multiple)

    return GpuPolicy


def count_reads(run_dir: str, overrides: list[str]) -> dict[int, list[str]]:
    from seektrain import platform
    from seektrain.config.loader import load_config
    from seektrain.train import faults
    from seektrain.train.trainer import train

    _GpuPolicy = _gpu_policy_class()
    reads: dict[int, list[str]] = defaultdict(list)
    step = [0]  # the step whose iteration of the training loop is running (0: none yet)

    def counted(name, original):
        def read(self, *args, **kwargs):
            if step[0]:
                reads[step[0]].append(f"{name} at {_caller()}")
            return original(self, *args, **kwargs)
        return read

    begin_step = faults.FaultGuard.begin_step

    def begin(self, n: int) -> None:
        step[0] = n
        begin_step(self, n)

    def device_sync(message, category, filename, lineno, file=None, line=None):
        if step[0] and "synchroniz" in str(message):
            reads[step[0]].append(f"cuda sync at {_caller()}: {str(message).splitlines()[0]}")
        else:
            show(message, category, filename, lineno, file, line)

    originals = {name: getattr(torch.Tensor, name) for name in READS}
    faults.FaultGuard.begin_step = begin
    platform.policy_for = lambda device: _GpuPolicy()  # the generic (GPU) path's kernels
    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    show, cuda = warnings.showwarning, torch.cuda.is_available()
    try:
        with warnings.catch_warnings():
            if cuda:
                warnings.simplefilter("always")
                warnings.showwarning = device_sync
                torch.cuda.set_sync_debug_mode("warn")
            train(load_config(None, [f"run.dir={run_dir}", *overrides]))
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = show
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return reads


def main(argv: list[str]) -> None:
    run_dir, rest = argv[0], argv[1:]
    overrides = [rest[i + 1] for i in range(0, len(rest), 2) if rest[i] == "--set"]
    reads = count_reads(run_dir, overrides)
    print(json.dumps({"reads": {str(k): v for k, v in sorted(reads.items())}}))


if __name__ == "__main__":
    main(sys.argv[1:])
