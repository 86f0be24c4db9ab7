"""The run folder: free space, write speed (write + fsync of a bounded file) and, across ranks, whether
every rank sees the files of every other (checkpoints need one shared folder).

What is a blocker: a run folder that cannot be created or written (read-only, permissions, full), less
free space than ``min_free_gib``, or ranks that do not see each other's files.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from seektrain.doctor.check_report import Check
from seektrain.parallel.dist_env import node_label

GIB = 2**30
PROBE = ".seektrain-doctor"  # every file the doctor writes starts with this and is removed again


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.0f} MiB"


def disk_checks(
    run_dir: Path, min_free_gib: float, write_mib: int, checkpoint_bytes: int | None
) -> list[Check]:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        speed = write_speed(run_dir, write_mib)
    except OSError as err:
        return [
            Check(
                "blocker",
                "run.dir",
                f"{run_dir} cannot be written: {err.strerror or err}; training could "
                "not save its config, logs or checkpoints: pick another run.dir or "
                "fix its permissions/space",
            )
        ]
    usage = shutil.disk_usage(run_dir)
    free = usage.free / GIB
    checks = [Check("ok", "run.dir", f"{run_dir}: writable")]
    if free < min_free_gib:
        checks.append(
            Check(
                "blocker",
                "disk",
                f"{free:.1f} GiB free under {run_dir}, below --min-free-gib "
                f"{min_free_gib:g}: checkpoints would fail; free space or move "
                "run.dir",
            )
        )
    elif checkpoint_bytes and usage.free < checkpoint_bytes:
        checks.append(
            Check(
                "warn",
                "disk",
                f"{free:.1f} GiB free, but the kept checkpoints need about "
                f"{_size(checkpoint_bytes)} (fp32 weights + AdamW state, "
                "checkpoint.keep + 1 in flight)",
            )
        )
    else:
        need = f"; kept checkpoints need about {_size(checkpoint_bytes)}" if checkpoint_bytes else ""
        checks.append(Check("ok", "disk", f"{free:.1f} GiB free of {usage.total / GIB:.1f} GiB{need}"))
    mib_s = write_mib / speed
    checks.append(
        Check(
            "ok" if mib_s >= 50 else "warn",
            "write speed",
            f"{mib_s:.0f} MiB/s ({write_mib} MiB written and fsynced)"
            + (
                ""
                if mib_s >= 50
                else ": checkpoints will stall training; consider async_save or faster storage"
            ),
        )
    )
    return checks


def write_speed(run_dir: Path, mib: int) -> float:
    """Seconds to write ``mib`` MiB into ``run_dir`` and fsync it (the file is removed again)."""
    path = run_dir / f"{PROBE}-write-{uuid.uuid4().hex[:8]}"
    block = os.urandom(2**20)
    start = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(time.perf_counter() - start, 1e-9)
    finally:
        path.unlink(missing_ok=True)


def shared_storage_check(run_dir: Path, rank: int, world: int, barrier, all_gather_object) -> Check:
    """Every rank writes a file into ``run_dir``; after a barrier every rank reads every other's. Run on
    all ranks together (``barrier()`` and ``all_gather_object(obj) -> list`` are the process group's)."""
    token = uuid.uuid4().hex
    names = all_gather_object(f"{PROBE}-rank{rank}-{token}")
    hosts = all_gather_object(node_label())
    error = ""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / names[rank]).write_text(token)
    except OSError as err:
        error = f"rank {rank} cannot write {run_dir}: {err.strerror or err}"
    barrier()
    unseen = []
    for other in range(world):
        try:
            seen = (run_dir / names[other]).read_text() == names[other].rsplit("-", 1)[-1]
        except OSError:
            seen = False
        if not seen:
            unseen.append(other)
    results = all_gather_object((error, unseen))
    barrier()
    (run_dir / names[rank]).unlink(missing_ok=True)
    errors = [e for e, _ in results if e]
    missing = {r: u for r, (_, u) in enumerate(results) if u}
    if errors or missing:
        lines = errors + [
            f"rank {r} ({hosts[r]}) does not see the files of rank(s) "
            f"{', '.join(f'{o} ({hosts[o]})' for o in u)}"
            for r, u in missing.items()
        ]
        return Check(
            "blocker",
            "shared storage",
            f"{run_dir} is not one folder shared by all {world} ranks: "
            "checkpoints and resume need that; put run.dir on a shared filesystem\n" + "\n".join(lines),
        )
    nodes = len(set(hosts))
    return Check(
        "ok", "shared storage", f"{run_dir}: all {world} ranks on {nodes} host(s) see each other's files"
    )


def model_read_checks(folder: Path | None, read_mib: int) -> list[Check]:
    """The raw read rate of ``model.hf_path``'s weight files (``folder``, a hub id resolved by the CLI):
    up to ``read_mib`` MiB of them, the page cache of each file dropped first with ``posix_fadvise``, so
    it is the disk's rate and not memory's; the figure the start-up log's load rate compares with."""
    if folder is None:
        return []
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return [Check("warn", "model read speed", f"{folder}: no safetensors files to read")]
    try:
        nbytes, seconds = read_speed(files, read_mib * 2**20)
    except OSError as err:
        return [Check("blocker", "model read speed", f"{folder}: cannot be read ({err.strerror or err})")]
    rate = nbytes / max(seconds, 1e-9) / 1e9
    return [
        Check(
            "ok",
            "model read speed",
            f"{rate:.2f} GB/s raw read of {folder} ({nbytes / 2**20:.0f} MiB of {len(files)} weight "
            "file(s), page cache dropped)",
        )
    ]


def read_speed(files: list[Path], limit: int) -> tuple[int, float]:
    """(bytes, seconds) reading ``files`` in order, 8 MiB at a time, up to ``limit`` bytes."""
    total, start = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while total < limit:
                chunk = os.read(fd, min(8 * 2**20, limit - total))
                if not chunk:
                    break
                total += len(chunk)
        finally:
            os.close(fd)
        if total >= limit:
            break
    return total, time.perf_counter() - start
