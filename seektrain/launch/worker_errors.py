"""A worker's error reaches the user once: workers started by our launcher write their one line into
torchrun's per-worker error file instead of stderr (``cli/errors.py``), and the launcher prints each
distinct line once, with the ranks that said it, instead of one copy per rank plus torchrun's traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

from seektrain.cli.errors import EXIT_FAILED, EXIT_USER_ERROR, QUIET_WORKERS_ENV


@contextlib.contextmanager
def quiet_workers() -> Iterator[None]:
    """Workers started inside this block leave their error lines to ``report_failures``; torchrun's own
    'failed (exitcode: N)' log line is dropped too, since ``report_failures`` says it better."""
    before = os.environ.get(QUIET_WORKERS_ENV)
    os.environ[QUIET_WORKERS_ENV] = "1"
    # torchrun sets 1 itself and prints a banner about it; setting it here does the same, quietly
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    api_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    api_log.addFilter(_drop_exit_lines)
    try:
        yield
    finally:
        api_log.removeFilter(_drop_exit_lines)
        if before is None:
            os.environ.pop(QUIET_WORKERS_ENV, None)
        else:
            os.environ[QUIET_WORKERS_ENV] = before


def _drop_exit_lines(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def report_failures(failures: dict) -> int:
    """Print each distinct worker message once; exit 2 when every failed worker refused bad input."""
    said: dict[str, list[int]] = {}
    silent: list[str] = []
    for rank, failure in sorted(failures.items()):
        message = failure.message if isinstance(failure.message, str) else ""
        if message.startswith("seektrain:"):
            said.setdefault(message, []).append(rank)
        else:  # killed by a signal, or died before it could say why
            silent.append(f"rank {rank} (exit code {failure.exitcode})")
    for message, ranks in said.items():
        where = f" [rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}]" if len(failures) > 1 else ""
        print(message + where, file=sys.stderr)
    if silent:
        print(f"seektrain: error: training workers failed without a message: {', '.join(silent)}; see the log "
              "above and run.dir/train.log", file=sys.stderr)
    # A worker that refused bad input may be stopped by a signal while exiting: its line decides.
    all_bad_input = not silent and all(m.startswith("seektrain: error:") for m in said) and any(
        f.exitcode == EXIT_USER_ERROR for f in failures.values())
    return EXIT_USER_ERROR if all_bad_input else EXIT_FAILED
