"""The checkpoint rows of bench_gpu.py: how long training stands still for one synchronous and one
asynchronous save of the dense model with its AdamW state, through the trainer's own ``CheckpointManager``.

The stall is the wall time of ``CheckpointManager.save`` (what ``train()`` calls between steps): for a
synchronous save the whole write, checksums and commit; for ``checkpoint.async_save`` the time until it
returns (the state is staged in host memory), the rest (``wait``: write, checksums, commit) being reported
apart as background time. The model is fp32 on the device, as the trainer keeps its master weights,
with both AdamW moments, so what is saved is what a one-rank training run of it saves. Whatever the
manager records about its stall (attributes or log lines naming a stall or blocking time) is reported
too.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import time
from pathlib import Path

import torch
from bench_gpu_common import NOT_SELECTED, Results, run_row, sync

_RECORDED = re.compile(r"stall|block|stag", re.IGNORECASE)


@contextlib.contextmanager
def captured_logs(name: str):
    """Lines logged under ``name`` (INFO and up) while the block runs."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger, handler = logging.getLogger(name), Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def checkpoint_rows(results: Results, cfg, work: Path, device: torch.device, selected: set[str]) -> None:
    from seektrain.checkpoint.manager import CheckpointManager
    from seektrain.config.schema import OptimSection
    from seektrain.models import build_model
    from seektrain.parallel.distributed import init_distributed
    from seektrain.train.optim import build_optimizer

    rows = [r for r in ("ckpt_sync", "ckpt_async") if r in selected]
    for row in {"ckpt_sync", "ckpt_async"} - set(rows):
        results.row("dense", row, {"skipped": NOT_SELECTED})
    if not rows:
        return
    init_distributed()  # the single-rank process group the trainer runs with (the manager's gloo group)
    model = build_model(cfg, device=device, dtype=torch.float32, seed=0)
    optimizer = build_optimizer(model, OptimSection())
    for p in model.parameters():  # one step with zero gradients creates both AdamW moments
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    state_bytes = _tensor_bytes(model.parameters()) + sum(
        _tensor_bytes(s.values()) for s in optimizer.state.values())
    try:
        for row in rows:
            async_save = row == "ckpt_async"
            folder = work / f"ckpt-{row}"

            def one(folder=folder, async_save=async_save):
                manager = CheckpointManager(folder, keep=1, async_save=async_save, rank=0)
                with captured_logs("seektrain.checkpoint") as logs:
                    sync(device)
                    t0 = time.perf_counter()
                    manager.save(1, model, optimizer, {"step": 1})
                    stall = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    manager.wait()
                    background = time.perf_counter() - t1
                recorded = {k: v for k, v in vars(manager).items()
                            if _RECORDED.search(k) and isinstance(v, (int, float)) and not isinstance(v, bool)}
                return {"stall_s": stall, "background_s": background if async_save else None,
                        "state_bytes": state_bytes, "bytes_written": _folder_bytes(folder / "checkpoints"),
                        "recorded_by_manager": recorded or None,
                        "manager_log": [ln for ln in logs if _RECORDED.search(ln)] or logs[-3:],
                        "note": "stall_s: wall time of CheckpointManager.save (fp32 weights + AdamW moments)"}

            try:
                run_row(results, "dense", row, selected, one, device)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        del model, optimizer
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
