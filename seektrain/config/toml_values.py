"""Config values written as text that the config loader reads back: TOML for files and ``--set`` for the
command line. The planner prints both for the layout it picks, and ``config show`` writes whole configs,
so a pasted block starts a run with exactly the values printed."""

from __future__ import annotations

import json
import math
import shlex


def toml_value(value: object) -> str:
    """A TOML literal for a config value: booleans as ``true``/``false``, strings as basic strings (JSON's
    escapes are TOML's), numbers as written, lists element by element. Anything else is a bug here, not
    a user's: a config holds only these types."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return json.dumps(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "inf" if value > 0 else "-inf" if value < 0 else "nan"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for config value {value!r} ({type(value).__name__})")


def set_value(value: object) -> str:
    """A ``--set KEY=VALUE`` value as the loader parses it (``true``/``false``, a bare string, ``a,b`` for
    a list), shell-quoted once, as a whole, where the shell would split or expand it."""
    return shlex.quote(_set_text(value))


def _set_text(value: object) -> str:
    if isinstance(value, bool):
        return toml_value(value)
    if isinstance(value, (list, tuple)):
        return ",".join(_set_text(v) for v in value)
    return str(value)
