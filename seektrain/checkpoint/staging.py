"""The two halves of an async save: a snapshot of the state in host memory, taken on the training
thread, and the writing of that snapshot on a background thread.

Why this split: training may change the weights as soon as ``save()`` returns, so the training thread
must copy them first; that copy is the whole stall an async checkpoint costs. Everything slower (the
DCP write, fsync, and rank 0's sha256 of every file) then runs in the background.

The snapshot uses DCP's ``DefaultStager`` (``torch.distributed.checkpoint.staging``):

* it keeps one host buffer per device storage (a cache keyed by the storage) and copies into the same
  buffers on every later save, so only the first save allocates, and on a GPU pins, host memory:
  page-locking gigabytes takes seconds, copying into pinned memory runs at bus speed;
* on a GPU the buffers are pinned and the device-to-host copies are issued with ``non_blocking=True``
  and synchronised once, so the stall is the copy at bus speed;
* on the CPU nothing is pinned (a CPU-only torch cannot) and the copies are plain: the state is already
  in host memory, the copy is what makes it a snapshot;
* no shared memory (the writer is a thread of this process, not DCP's checkpoint process) and no async
  staging (``save()`` returns only once the copy is done, so the caller may change the weights).

A save waits for the previous one before it stages, so a buffer is never overwritten while it is written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def staging_options(pinned: bool):
    """DCP's ``StagingOptions``; ``pinned``: the platform's ``pin_host_memory()`` (true only with an
    accelerator). Imported here, not at the top: only async saves need it (torch >= 2.9)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(
        use_pinned_memory=pinned,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=pinned,
    )


def snapshot_stager(pinned: bool):
    """A ``DefaultStager`` to keep for the whole run (its cache is the reuse); ``close()`` it at the end."""
    from torch.distributed.checkpoint.staging import DefaultStager

    return DefaultStager(staging_options(pinned))


def run_in_background(work: Callable[[], Any], name: str) -> Future:
    """Run ``work`` on a new daemon thread; its result or exception arrives in the returned future.

    A daemon thread, not an executor's: a run that fails while a checkpoint is being written then exits
    at once instead of waiting for the write (whose collectives may wait for a dead rank); the
    unfinished ``.tmp`` folder is removed at the next start. A run that ends normally waits for the
    write itself (``CheckpointManager.wait``)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
