"""The checkpoint rows of bench_gpu.py: how long training stands still for one synchronous and one
asynchronous save of the dense model with its AdamW state, through the trainer's own ``CheckpointManager``.

The stall is what the training thread spends in the checkpoint (``checkpoint_stall_s`` in a run's
metrics): the wall time of ``CheckpointManager.save`` (what ``train()`` calls between steps) plus, for
``checkpoint.async_save``, the commit once the background write is done. For a synchronous save that is
the whole write, checksums and commit; for an async save the snapshot of the state in pinned host memory
(the platform's ``pin_host_memory()``, as the trainer does) and the commit, the write and checksums in
between being reported apart as background time. Two saves are made with one manager: the first
allocates and pins the host buffers, the second reuses them, as every later save of a run does; the
second is ``stall_s``, the first ``first_stall_s``. The model is fp32 on the device, as the trainer keeps
its master weights, with both AdamW moments, so what is saved is what a one-rank training run of it
saves. Whatever the manager records about its stall (attributes or log lines naming a stall or blocking
time) is reported too.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from pathlib import Path

import torch

from bench_checkpoint import folder_bytes, timed_save
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


def checkpoint_rows(results: Results, cfg, work: Path, device: torch.device, selected: set[str]) -> None:
    from seektrain.checkpoint.manager import CheckpointManager
    from seektrain.config.schema import OptimSection
    from seektrain.models import build_model
    from seektrain.parallel.process_group import init_distributed
    from seektrain.platform import policy_for
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
        _tensor_bytes(s.values()) for s in optimizer.state.values()
    )
    try:
        for row in rows:
            async_save = row == "ckpt_async"
            folder = work / f"ckpt-{row}"

            def one(folder=folder, async_save=async_save):
                manager = CheckpointManager(
                    folder,
                    keep=1,
                    async_save=async_save,
                    rank=0,
                    pin_memory=policy_for(device).pin_host_memory(),
                )
                saves = []
                with captured_logs("seektrain.checkpoint") as logs:
                    for step in (1, 2):
                        saves.append(timed_save(manager, step, model, optimizer, device))
                    manager.close()
                first, later = saves
                recorded = {
                    k: v
                    for k, v in vars(manager).items()
                    if _RECORDED.search(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
                }
                return {
                    "stall_s": later["save_s"] + later["commit_s"],
                    "first_stall_s": first["save_s"] + first["commit_s"],
                    "save_s": later["save_s"],
                    "commit_s": later["commit_s"] if async_save else None,
                    "background_s": later["background_s"] if async_save else None,
                    "pinned": manager.pin_memory and async_save,
                    "state_bytes": state_bytes,
                    "bytes_written": folder_bytes(folder / "checkpoints"),
                    "recorded_by_manager": recorded or None,
                    "manager_log": [ln for ln in logs if _RECORDED.search(ln) or "committed" in ln]
                    or logs[-3:],
                    "note": "stall_s: CheckpointManager.save + commit of the second save on the training thread "
                    "(fp32 weights + AdamW moments); first_stall_s: the first, which allocates the "
                    "host buffers",
                }

            try:
                run_row(results, "dense", row, selected, one, device)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        model = optimizer = None  # frees them: the row function above holds them too
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
