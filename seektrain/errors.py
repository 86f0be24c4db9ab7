"""The two kinds of error that end a command with one line instead of a traceback.

Why two narrow types: printing every ``ValueError`` and ``OSError`` as a one-line "user error" would
hide torch's own bugs and ours, tracebacks lost. Only these are one line (``cli/error_lines.py``); anything
else is a bug whose traceback goes to ``train.log``.

* ``UserError``: the input is wrong (a config key, a flag, a data folder, a checkpoint, a model file).
  Raised where the input is read, with a message naming the input and the fix. It subclasses
  ``ValueError`` so that code validating values keeps catching what it always caught.
* ``RunFailure``: the input was fine and the run stopped for a known reason outside our code (out of
  memory, a dead or hung rank, a bad loss under ``train.on_bad_loss=stop``, a checkpoint the disk
  would not take); the message names what happened and what to try.

This module imports only the standard library, so every layer (``config``, ``models``, ``data``, ``checkpoint`` ...) can
raise them.
"""

from __future__ import annotations

import contextlib

# How the one line of a worker stopped by SIGTERM starts (train/preemption.py; the launcher relays it:
# launch/worker_errors.py); its exit status is exit_codes.EXIT_PREEMPTED
PREEMPTED = "seektrain: preempted"


class UserError(ValueError):
    """Bad input: the message names the config key, flag or file at fault and the fix."""


class ConfigError(UserError):
    """A user mistake in a config file or override (``seektrain.config.loader`` re-exports it; defined here
    so that ``models/job_model.py``, which chooses the model a job names, raises it too)."""


class RunFailure(Exception):
    """A known failure of a run on good input; the message names what happened and what to try."""


@contextlib.contextmanager
def user_path(what: str, fix: str = "choose a folder you can write"):
    """An ``OSError`` while creating, reading or writing a path the user named (``what``: the flag or key
    and its value) is bad input, not a bug: one ``UserError`` line naming the path, the reason and ``fix``."""
    try:
        yield
    except OSError as err:
        raise UserError(
            f"{what}: {err.strerror or err}{f' ({err.filename})' if err.filename else ''}; {fix}"
        ) from None
