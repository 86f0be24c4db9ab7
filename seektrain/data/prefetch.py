"""Training batches read ahead in a background thread, so a step does not wait for its batch.

Why a thread and not DataLoader worker processes: a batch here is a few slices of memory-mapped shards
(no decoding), so one thread keeps ahead easily, and it shares the loader object, so there is no
worker state to merge for a checkpoint. What the thread hides is that read and, on a GPU, the copy of
the batch into pinned (page-locked) host memory: only from pinned memory is the step's
``tensor.to(device, non_blocking=True)`` a truly asynchronous copy.

Exact resume: the thread runs ahead, so the wrapped loader's own position counts the batches *read*,
not those *trained on*. Each batch therefore travels with the loader's state right after it was read,
and ``state_dict()`` is the state of the last batch handed out: what a checkpoint must hold. Batches
read ahead but not trained on when a run stops are read again after the resume.

Errors: an exception of the loader (or of pinning) in the thread takes the place of the batch it
failed to make and is re-raised, unchanged, in the thread that asks for that batch, so the user sees
the same one line as without read-ahead, at the same step.

Stopping: ``close()`` sets an event that the thread checks at least every ``POLL_S`` and joins it; the
trainer calls it in its ``finally`` (end of training, errors, preemption). The thread is a daemon as
well, so it can never keep a finished process alive.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from seektrain.data.batch import Batch
from seektrain.errors import UserError

POLL_S = 0.1  # how often a waiting thread checks for close() and the consumer checks the thread is alive
_END = object()  # the wrapped iterator ended


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def use_device(device: torch.device) -> None:
    """Make ``device`` current in the prefetch thread, so that pinning does not create a context on
    device 0 (a new thread's default) on every rank of a node."""
    torch.accelerator.set_device_index(device)


def pin(batch: Batch) -> Batch:
    return batch.pin_memory()


class PrefetchingLoader:
    """Iterator over the batches of ``loader`` (any iterator with ``state_dict``/``load_state_dict``),
    read up to ``depth`` batches ahead by a background thread; ``depth=0`` reads in the caller. With
    ``pin_device`` (an accelerator device) the thread also pins each batch in host memory."""

    def __init__(self, loader, depth: int, pin_device: torch.device | None = None):
        if depth < 0:
            raise UserError(f"data.prefetch={depth}: must be >= 0 (0 = no read-ahead)")
        self.loader, self.depth, self.pin_device = loader, depth, pin_device
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] | None = None  # the loader's state after the last batch handed out
        self._failure: BaseException | None = None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.depth == 0:
            return next(self.loader)
        if self._failure is not None:
            raise self._failure
        if self._thread is None:
            self._start()
        item = self._take()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failed):
            self._failure = item.error
            raise item.error
        batch, self._state = item
        return batch

    def _start(self) -> None:
        if self._stop.is_set():
            raise RuntimeError("this PrefetchingLoader is closed")
        self._state = self.loader.state_dict()
        self._thread = threading.Thread(target=self._run, name="seektrain-prefetch", daemon=True)
        self._thread.start()

    def _take(self):
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not (self._thread and self._thread.is_alive()) and self._queue.empty():
                    raise RuntimeError(
                        "the data prefetch thread stopped without a batch or an error"
                    ) from None

    def _run(self) -> None:
        try:
            if self.pin_device is not None:
                use_device(self.pin_device)
            while not self._stop.is_set():
                try:
                    batch = next(self.loader)
                except StopIteration:
                    self._put(_END)
                    return
                if self.pin_device is not None:
                    batch = pin(batch)
                if not self._put((batch, self.loader.state_dict())):
                    return
        except BaseException as err:
            self._put(_Failed(err))

    def _put(self, item) -> bool:
        """Queue ``item``, waiting while the queue is full; False when closed first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (not after the batches read ahead)."""
        return self.loader.state_dict() if self._state is None else dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("load the data position before the first batch is read")
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 * POLL_S + 5)
        while not self._queue.empty():
            self._queue.get_nowait()
