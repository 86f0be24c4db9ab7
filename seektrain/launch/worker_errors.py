"""A worker's error reaches the user once: workers started by our launcher leave their one line in a
folder the launcher made (``cli/error_lines.py``), and the launcher prints each distinct line once, with the
ranks that said it, instead of one copy per rank plus torchrun's traceback. (torchrun's own per-worker
error files are not used: a file there changes which failure torchrun reports as the first.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from seektrain.errors import PREEMPTED
from seektrain.exit_codes import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USER_ERROR

# Set by our launcher for its workers: the folder where each worker leaves its error line (rank-N.txt,
# written by cli/error_lines.py), and whether the worker should leave the printing to the launcher.
ERROR_DIR_ENV = "SEEKTRAIN_WORKER_ERRORS"
QUIET_WORKERS_ENV = "SEEKTRAIN_QUIET_WORKERS"


@contextlib.contextmanager
def worker_error_folder(quiet: bool) -> Iterator[Path]:
    """The folder workers started inside this block leave their error lines in; ``quiet`` (no restarts)
    leaves the printing to ``report_failures``, and drops torchrun's log lines about a refused input."""
    folder = Path(tempfile.mkdtemp(prefix="seektrain-worker-errors-"))
    saved = {k: os.environ.get(k) for k in (ERROR_DIR_ENV, QUIET_WORKERS_ENV)}
    os.environ[ERROR_DIR_ENV] = str(folder)
    if quiet:
        os.environ[QUIET_WORKERS_ENV] = "1"
    # torchrun sets 1 itself and prints a banner about it; setting it here does the same, quietly
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    api_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    api_log.addFilter(_drop_exit_lines)
    try:
        yield folder
    finally:
        api_log.removeFilter(_drop_exit_lines)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(folder, ignore_errors=True)


def _drop_exit_lines(record: logging.LogRecord) -> bool:
    """Drop 'failed (exitcode: 2)' (a refused input: ``report_failures`` prints its line) and the SIGTERM
    notices of the peers stopped after it; a crash (exit -9, 1...) keeps torchrun's line, which says that
    workers are being restarted."""
    msg = str(record.msg)
    if msg.startswith("failed (exitcode"):
        return not (record.args and record.args[0] == EXIT_USER_ERROR)
    return not msg.startswith("Sending process")


def report_failures(failures: dict, folder: Path | None = None, what: str = "training") -> int:
    """Print each distinct worker line once (from ``folder``); exit 2 when the workers refused bad input."""
    said: dict[str, list[int]] = {}
    silent: list[str] = []
    for rank, failure in sorted(failures.items()):
        message = _line(folder, rank) if folder else ""
        if message.startswith("seektrain:"):
            said.setdefault(message, []).append(rank)
        else:  # killed by a signal, or died before it could say why
            silent.append(f"rank {rank} (exit code {failure.exitcode})")
    for message, ranks in said.items():
        where = f" [rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}]" if len(failures) > 1 else ""
        print(message + where, file=sys.stderr)
    if silent:
        where = "the log above and run.dir/train.log" if what == "training" else "the output above"
        print(
            f"seektrain: error: {what} workers failed without a message: {', '.join(silent)}; see {where}",
            file=sys.stderr,
        )
    if said and not silent and all(m.startswith(PREEMPTED) for m in said):
        return EXIT_PREEMPTED  # SIGTERM reached the workers and not this launcher: they saved and left
    # A worker that refused bad input may be stopped by a signal while exiting: its line decides.
    all_bad_input = (
        not silent
        and all(m.startswith("seektrain: error:") for m in said)
        and any(f.exitcode == EXIT_USER_ERROR for f in failures.values())
    )
    return EXIT_USER_ERROR if all_bad_input else EXIT_FAILED


def preempted_line(folder: Path) -> str:
    """The line of the lowest rank stopped by SIGTERM (train/preemption.py), or ""."""
    ranks = sorted(int(p.stem.removeprefix("rank-")) for p in folder.glob("rank-*.txt"))
    return next((line for r in ranks if (line := _line(folder, r)).startswith(PREEMPTED)), "")


def _line(folder: Path, rank: int) -> str:
    try:
        return (folder / f"rank-{rank}.txt").read_text(encoding="utf-8").strip()
    except OSError:
        return ""
