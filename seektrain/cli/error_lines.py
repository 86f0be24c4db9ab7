"""The one error path of the CLI: a user mistake is one line on stderr and exit status 2; an internal
error is one line saying where its traceback went; under a launcher a worker's line reaches the user once.

Why here and not in each command: every verb then fails the same way, and a test can hold all of them to
it by calling ``seektrain.cli.main.main(argv)`` in one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from seektrain.exit_codes import EXIT_FAILED, EXIT_USER_ERROR
from seektrain.launch.worker_errors import ERROR_DIR_ENV, QUIET_WORKERS_ENV


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus an error; we print only the error, naming the command to get help."""

    def error(self, message: str):  # type: ignore[override]
        command = self.prog.removeprefix("seektrain").strip()
        print(
            f"seektrain: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USER_ERROR)


def one_line(text: str) -> str:
    """Messages from libraries may span lines; the user gets the first one that says something."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " ".join(lines[:1]) if lines else "unknown error"


def report_user_error(err: BaseException) -> int:
    """Print ``seektrain: error: ...`` once (for a worker: leave it to the launcher) and return 2."""
    _tell(f"seektrain: error: {one_line(err)}")
    return EXIT_USER_ERROR


def report_preempted(line: str, code: int) -> int:
    """A worker stopped by SIGTERM: its one line (what run.dir holds) reaches the user once, like an
    error's; ``code`` is 143."""
    _tell(line)
    return code


def report_internal_error(err: BaseException, log_dir: str | Path | None) -> int:
    """Write the traceback into ``log_dir/train.log`` (else a temp file) and print one line naming it."""
    text = "".join(traceback.format_exception(err))
    path = _append_log(Path(log_dir) / "train.log", text) if log_dir else None
    if path is None:
        fd, name = tempfile.mkstemp(prefix="seektrain-error-", suffix=".log")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        path = Path(name)
    _tell(
        f"seektrain: internal error: {type(err).__name__}: {one_line(err)}; the traceback is in {path} "
        "(please report it with that file)"
    )
    return EXIT_FAILED


def _append_log(path: Path, text: str) -> Path | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(
                f"{time.strftime('%Y-%m-%d %H:%M:%S')} internal error, rank {os.environ.get('RANK', '0')}:\n{text}"
            )
        return path
    except OSError:
        return None


def _tell(line: str) -> None:
    """A worker of our launcher leaves the line in the launcher's folder and, unless the launcher restarts
    workers (then every attempt's lines matter), stays quiet; anything else prints it."""
    folder = os.environ.get(ERROR_DIR_ENV)
    recorded = False
    if folder:
        try:
            Path(folder, f"rank-{int(os.environ.get('RANK', '0'))}.txt").write_text(line, encoding="utf-8")
            recorded = True
        except (OSError, ValueError):
            pass  # could not record it: print it instead
    if not (recorded and os.environ.get(QUIET_WORKERS_ENV)):
        print(line, file=sys.stderr, flush=True)
