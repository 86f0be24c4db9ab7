"""The hook point for code outside seektrain that must act inside a real training process: the tests'
fault injection (a rank killed mid-run, a full disk, a NaN loss, a SIGTERM at a chosen moment).

Why: those failure paths are reached through a real ``seektrain train`` subprocess, often a torchrun
worker, where only the environment gets in; and test code has no place in the shipped package. So
``SEEKTRAIN_TEST_HOOKS`` names a module (importable by name, or a ``.py`` file's path) and the trainer
calls its functions, each optional, at three moments of the run:

    at_startup(rank, preemption)  first thing in the worker, before the process group (``rank``:
                                  torchrun's RANK; ``preemption``: the SIGTERM handler, train/preemption.py)
    at_data(rank)                 after the run.dir checks, before the data is opened
    at_steps(sync, rank)          before the model is built; ``sync`` is the run's ``StepSync``
                                  (``sync.step``: the step running; ``sync.begin_step``: called first
                                  in every step; ``sync.preemption``)

Unset (every normal run) nothing is imported and the calls do nothing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

from seektrain.errors import UserError

HOOKS_ENV = "SEEKTRAIN_TEST_HOOKS"


@functools.cache
def _module() -> ModuleType | None:
    name = os.environ.get(HOOKS_ENV, "")
    if not name:
        return None
    try:
        if not name.endswith(".py"):
            return importlib.import_module(name)
        spec = importlib.util.spec_from_file_location("seektrain_test_hooks", name)
        if spec is None or spec.loader is None:
            raise ImportError("not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as err:
        raise UserError(
            f"{HOOKS_ENV}={name!r}: cannot import it ({err}); unset it for a normal run"
        ) from None


def run_hook(moment: str, *args) -> None:
    """Call the hook module's function ``moment`` with ``args``; nothing without a module or function."""
    module = _module()
    hook = getattr(module, moment, None) if module is not None else None
    if hook is not None:
        hook(*args)
