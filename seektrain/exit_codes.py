"""Every exit status the ``seektrain`` programs return, and what each means.

Why one module: the statuses are public interface (scripts, Slurm's requeue, Kubernetes restart
policies and the docs rely on them, ``docs/configuration.md``), and the CLI, the launcher, the trainer's
preemption and the doctor each return some of them; defined once here, they cannot drift apart. It
imports nothing, so every layer may use it.
"""

from __future__ import annotations

EXIT_OK = 0
"""The command did what was asked (a doctor report without blockers included)."""

EXIT_FAILED = 1
"""The input was fine and the command failed: an internal error (a bug: one line says where its
traceback went), a launch whose workers crashed, a rendezvous or store that could not be reached, or a
doctor report with a blocker."""

EXIT_USER_ERROR = 2
"""Bad input (a config key, a flag, a file: ``UserError``) or a known failure of the run
(``RunFailure``: out of memory, a lost peer, a bad loss under ``train.on_bad_loss=stop``); one line
names it and the fix. Also argparse's refusals and a verb given without its sub-command."""

SIGNAL_BASE = 128
"""A process ended by signal N exits 128 + N, as a shell reports it (``signal_exit``)."""

EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT, 128 + 2): the user stopped the command."""

EXIT_PREEMPTED = 143
"""SIGTERM (128 + 15): a worker stopped by it saved what the moment allows (train/preemption.py) and its
one line says what run.dir holds; the launcher returns it too, so a Slurm script requeues the job."""


def signal_exit(signum: int) -> int:
    """The status of a process ended by signal ``signum`` (the launcher's, stopped by one)."""
    return SIGNAL_BASE + int(signum)
