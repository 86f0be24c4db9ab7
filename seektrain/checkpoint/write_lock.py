"""Who is writing a ``checkpoints/step-N.tmp/`` folder: an ``flock`` on ``.lock`` inside it.

Why a lock and not a guess: a ``.tmp`` folder is either a checkpoint that a live process is writing
(an async save, another job on the same run dir) or the leftover of a crash. Only the writer knows,
so it says so: the process that creates the folder holds an exclusive ``flock`` on its ``.lock`` file
from creation until the folder is committed (renamed) or removed. The kernel drops the lock when
that process dies, however it dies (even SIGKILL), so "the lock is free" means "nobody is writing".

The folder is born with its lock already held: it is made under a hidden staging name, the lock is
taken, and only then is it renamed to ``step-N.tmp``. So a ``step-N.tmp`` without a ``.lock`` was
never written by this code's current protocol and cannot be in progress.

On a shared file system the lock needs ``flock`` support across nodes (NFS has it; Lustre needs the
``flock`` mount option). Where taking a lock fails outright, the folder counts as in use and is kept.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger("seektrain.checkpoint")
LOCK = ".lock"


class WriteLock:
    """The held lock of one folder being written; ``release()`` when it is committed or removed."""

    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def create_locked(path: Path) -> WriteLock:
    """Create folder ``path`` (which must not exist) with its lock held by this process."""
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".new", dir=path.parent))
    fd = os.open(staging / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:  # no flock on this file system: write anyway, the folder will count as in use
        log.warning(
            "cannot lock %s (%s); stale checkpoint folders there will not be cleaned up", staging, err
        )
    os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
    try:
        os.rename(staging, path)  # fails if ``path`` exists and is not empty
    except OSError:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return WriteLock(fd)


def _try_lock(folder: Path) -> int | None:
    """An fd holding ``folder``'s lock, or None when someone else holds it (or it cannot be taken).
    A folder without a lock file gets -1: nothing of ours is writing it."""
    try:
        fd = os.open(folder / LOCK, os.O_RDWR)
    except FileNotFoundError:
        return -1
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held by a live writer; anything else: cannot tell, so keep it
        os.close(fd)
        return None
    return fd


def in_use(folder: Path) -> bool:
    """True when a live process holds ``folder``'s write lock (or the lock cannot be checked)."""
    fd = _try_lock(folder)
    if fd is None:
        return True
    if fd >= 0:
        os.close(fd)
    return False


def holder(folder: Path) -> str:
    """``host pid`` of the writer, as it recorded itself (for messages)."""
    try:
        return (folder / LOCK).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def remove_if_stale(folder: Path) -> bool:
    """Delete ``folder`` if nobody holds its lock (taking the lock first, so no writer can be in it);
    False when it is in use and was left alone."""
    fd = _try_lock(folder)
    if fd is None:
        return False
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        if fd >= 0:
            os.close(fd)
    return not folder.exists()
