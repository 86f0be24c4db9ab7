"""Count the host reads of tensor values (``item``, ``tolist``, ``float()``, ``int()``, ``bool()``, use as
an index, ``numpy``), the copies to the host (``.cpu()``, ``.to("cpu")``) and the operations whose output
size depends on the values (``nonzero``, ``masked_select``, indexing with a boolean mask) made on each
step of a tiny training run in this process, and print them as JSON.

On a GPU each such read waits for the device to finish everything queued before it; the trainer keeps
per-step values on the device and reads them only at flush steps (``run.log_interval``, the first and
last step, checkpoint and evaluation steps). ``tests/test_host_syncs.py`` runs this in a subprocess (the
run initialises a process group) and checks that no other step reads anything.

The run uses the generic platform policy, the one a GPU gets: the CPU policy's padded kernels may read
counts on the host, which costs nothing on a CPU. Reads inside torch's C++ (a CUDA ``bincount`` sizing
its output, a blocking copy) are invisible to the Python hooks; on a machine with CUDA the run also sets
``torch.cuda.set_sync_debug_mode("warn")`` and counts each synchronising operation it reports.

A ``.to(device)`` with a ``torch.device`` moves a tensor to where the run or another tensor computes
(``ctx.device``, ``bias.device``): on a GPU run, the GPU, so no read, although on this CPU run that device
is the host too. So a ``.to`` counts when it names the host as a string (``.to("cpu")``,
``.to(device="cpu")``), as code that wants a value on the host does; ``.cpu()`` always counts.

``--plant`` adds each kind of read after every step (a negative control: they must all be reported).

    python tests/host_reads.py RUN_DIR [--plant] --set model.preset=tiny-dense ...
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

READS = (
    "item",
    "tolist",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "numpy",
    "cpu",
    "nonzero",
    "masked_select",
)
FUNCTIONS = ("nonzero", "masked_select", "argwhere")  # the same reads as torch.* functions
PACKAGE = str(Path(__file__).resolve().parents[1] / "seektrain")
# The negative control (--plant): one of each kind of read the count must see, after every step.
PLANTED = {
    "cpu": lambda t: t.cpu(),
    "to": lambda t: t.to("cpu"),
    "nonzero": lambda t: t.nonzero(),
    "masked_select": lambda t: t.masked_select(t > 0),
    "boolean-mask index": lambda t: t[t > 0],
}


def _caller() -> str:
    """The innermost seektrain frame of the current stack (where the read was asked for), or the
    innermost frame outside this file."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__]
    ours = [f for f in frames if f.filename.startswith(PACKAGE)]
    f = (ours or frames)[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _is_bool_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in parts)


def _names_the_host(args, kwargs) -> bool:
    """``.to("cpu")``, ``.to(device="cpu")``: a copy to the host named as such."""
    return any(
        isinstance(t, str) and torch.device(t).type == "cpu" for t in (*args[:1], kwargs.get("device"))
    )


def _gpu_policy_class():
    from dataclasses import replace

    from seektrain.models.kernels import Kernels
    from seektrain.platform.policy import PlatformPolicy

    class GpuPolicy(PlatformPolicy):
        """The generic policy as an SM 9.0+ GPU has it: the experts run as one grouped GEMM (which this
        CPU runs in fp32 too), not the batched matmul that sizes its padding on the host."""

        def model_kernels(self, compute_dtype=torch.bfloat16) -> Kernels:
            plain = Kernels()
            return replace(
                super().model_kernels(compute_dtype),
                grouped_mm_dtypes=plain.grouped_mm_dtypes,
                grouped_mm_dim_multiple=plain.grouped_mm_dim_multiple,
            )

    return GpuPolicy


def count_reads(run_dir: str, overrides: list[str], plant: bool = False) -> dict[int, list[str]]:
    from seektrain import platform
    from seektrain.config.loader import load_config
    from seektrain.train import step_sync, trainer

    _GpuPolicy = _gpu_policy_class()
    reads: dict[int, list[str]] = defaultdict(list)
    step = [0]  # the step whose iteration of the training loop is running (0: none yet)

    def counted(name, original):
        def read(self, *args, **kwargs):
            if step[0]:
                reads[step[0]].append(f"{name} at {_caller()}")
            return original(self, *args, **kwargs)

        return read

    begin_step = step_sync.StepSync.begin_step

    def begin(self, n: int) -> None:
        step[0] = n
        begin_step(self, n)

    def device_sync(message, category, filename, lineno, file=None, line=None):
        if step[0] and "synchroniz" in str(message):
            reads[step[0]].append(f"cuda sync at {_caller()}: {str(message).splitlines()[0]}")
        else:
            show(message, category, filename, lineno, file, line)

    def counted_if(name, original, is_read):
        def call(self, *args, **kwargs):
            if step[0] and is_read(args, kwargs):
                reads[step[0]].append(f"{name} at {_caller()}")
            return original(self, *args, **kwargs)

        return call

    step_fn = trainer.train_step

    def planted_step(ctx, n):
        record = step_fn(ctx, n)
        for read in PLANTED.values():
            read(record.values["loss"])
        return record

    originals = {name: getattr(torch.Tensor, name) for name in (*READS, "to", "__getitem__")}
    functions = {name: getattr(torch, name) for name in FUNCTIONS}
    step_sync.StepSync.begin_step = begin
    platform.policy_for = lambda device: _GpuPolicy()  # the generic (GPU) path's kernels
    for name in READS:
        setattr(torch.Tensor, name, counted(name, originals[name]))
    torch.Tensor.to = counted_if("to", originals["to"], _names_the_host)
    torch.Tensor.__getitem__ = counted_if(
        "boolean-mask index", originals["__getitem__"], lambda args, kwargs: _is_bool_mask(args[0])
    )
    for name, original in functions.items():
        setattr(torch, name, counted(name, original))
    if plant:
        trainer.train_step = planted_step
    show, cuda = warnings.showwarning, torch.cuda.is_available()
    try:
        with warnings.catch_warnings():
            if cuda:
                warnings.simplefilter("always")
                warnings.showwarning = device_sync
                torch.cuda.set_sync_debug_mode("warn")
            trainer.train(load_config(None, [f"run.dir={run_dir}", *overrides]))
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = show
        trainer.train_step = step_fn
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in functions.items():
            setattr(torch, name, original)
    return reads


def main(argv: list[str]) -> None:
    run_dir, rest = argv[0], [a for a in argv[1:] if a != "--plant"]
    overrides = [rest[i + 1] for i in range(0, len(rest), 2) if rest[i] == "--set"]
    reads = count_reads(run_dir, overrides, plant="--plant" in argv)
    print(json.dumps({"reads": {str(k): v for k, v in sorted(reads.items())}}))


if __name__ == "__main__":
    main(sys.argv[1:])
