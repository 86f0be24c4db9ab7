"""Load a ``JobConfig`` from TOML plus ``--set section.key=value`` overrides, and validate it once.

Every mistake becomes a ``ConfigError`` with one line naming the key and the fix; nothing is
silently ignored (an unknown key is an error, not a no-op).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path

from seektrain.config.schema import JobConfig
from seektrain.config.toml_values import toml_value
from seektrain.errors import ConfigError, UserError

__all__ = ["ConfigError", "UserError"]  # ConfigError lives in seektrain.errors so models/ can raise it too


# Keys that moved: an old config gets one line naming the new key instead of "unknown key".
RENAMED_KEYS = {
    "train.cpu_keep_freed_memory": "cpu.keep_freed_memory",
    "train.collective_timeout_s": "dist.collective_timeout_s",
}


def _sections(cfg: JobConfig) -> dict[str, object]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _field_types(section: typing.Any) -> dict[str, type]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def leaf_keys(
    table: typing.Any, prefix: str = ""
) -> typing.Iterator[tuple[str, typing.Any, dataclasses.Field]]:
    """(dotted key, the dataclass holding it, its field) for every key under ``table``, in schema order.
    A field whose value is a dataclass is a sub-table (``[model.rope_scaling]``): its keys are listed,
    not it."""
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", table, f


def _coerce(key: str, value, typ):
    """Convert ``value`` (from TOML or a --set string) to ``typ``, or raise ConfigError."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, str):  # "1,2", "1 2" or TOML's "[1, 2]"
            text = value.strip()
            if text.startswith("[") != text.endswith("]") or "[" in text[1:-1] or "]" in text[1:-1]:
                raise ConfigError(f"{key}={value!r}: an unclosed or nested list; write it as [a, b] or a,b")
            value = text.removeprefix("[").removesuffix("]").replace(",", " ").split()
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported config type {typ} for {key}")


def _assign(cfg: JobConfig, dotted: str, value) -> None:
    if dotted in RENAMED_KEYS:
        new = RENAMED_KEYS[dotted]
        raise ConfigError(f"config key {dotted!r} moved to {new!r}; rename it in your config or --set")
    section_name, _, key = dotted.partition(".")
    sections = _sections(cfg)
    if section_name not in sections or not key:
        raise ConfigError(f"unknown config key {dotted!r}; sections are: {', '.join(sections)}")
    section, table = sections[section_name], section_name
    while True:  # down through sub-tables: model.rope_scaling.factor
        types = _field_types(section)
        name, _, rest = key.partition(".")
        if name not in types or (rest and not dataclasses.is_dataclass(types[name])):
            raise ConfigError(f"unknown config key {dotted!r}; keys of [{table}]: {', '.join(types)}")
        if not dataclasses.is_dataclass(types[name]):
            setattr(section, name, _coerce(dotted, value, types[name]))
            return
        section, table = getattr(section, name), f"{table}.{name}"
        if rest:
            key = rest
            continue
        if not isinstance(value, dict):  # a TOML [model.rope_scaling] table arrives as a dict
            raise ConfigError(f"{dotted}: is a table; set its keys ({', '.join(_field_types(section))})")
        for sub, item in value.items():
            _assign(cfg, f"{dotted}.{sub}", item)
        return


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; pass an existing TOML file to --config")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(
                f"config file {path} is not valid TOML: {str(err).splitlines()[0]}; fix the file"
            ) from None
        except RecursionError:
            raise ConfigError(
                f"config file {path} nests arrays or tables too deeply to be a config; fix the file"
            ) from None
        except OSError as err:
            raise ConfigError(
                f"config file {path} cannot be read ({err.strerror}); check its permissions"
            ) from None
        for section_name, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section_name!r} must be a [section] table")
            for key, value in table.items():
                _assign(cfg, f"{section_name}.{key}", value)
    for item in overrides:
        dotted, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        _assign(cfg, dotted.strip(), value.strip())
    return validate(cfg)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: JobConfig) -> JobConfig:
    """Checks that need no knowledge of the launched world size: first every key against the range,
    choices and finiteness its schema line declares, then the few rules that relate keys. (Whether
    ``model.preset`` names a preset is asked where the model is chosen, ``models/job_model.py``, and
    whether a tracker's package is installed by ``RunPlan.resolve``: this package knows nothing of either.)"""
    for dotted, section, f in leaf_keys(cfg):
        bounds = f.metadata.get("bounds")
        value = getattr(section, f.name)
        problem = bounds.problem(value) if bounds is not None else _finite_problem(value)
        _check(problem is None, f"{dotted}={_show(value)}: {problem}")
    t = cfg.train
    _check(
        t.global_batch_size % t.micro_batch_size == 0,
        f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
        f"{t.micro_batch_size}; make it one",
    )
    ac = t.activation_checkpoint
    _check(
        ac in ("none", "full", "selective")
        or (ac.startswith("every:") and ac[6:].isdigit() and int(ac[6:]) > 0),
        f"train.activation_checkpoint={ac!r}: use none, full, selective or every:K (K >= 1)",
    )
    p = cfg.precision
    _check(
        p.fp8 == "none" or p.dtype in ("bf16", "auto"),  # auto is bf16 on every GPU with FP8
        f"precision.fp8={p.fp8!r} runs the rest of the model in bf16, not precision.dtype={p.dtype!r}; "
        "set precision.dtype=bf16 or precision.fp8=none",
    )
    _check_resume(cfg.checkpoint.resume)
    _check_dist(cfg.dist)
    _check_trackers(cfg)
    _check_lora_targets(cfg.lora.target_modules)
    return cfg


LORA_GROUPS = ("attention", "mlp", "shared_experts", "experts")  # models/lora.py's target groups


def _check_lora_targets(targets: list[str]) -> None:
    """Each ``lora.target_modules`` entry is a group or a module-path pattern (module paths have dots:
    ``*.self_attn.o_proj``); whether a pattern matches the model is asked where the model is known."""
    for t in targets:
        _check(
            t in LORA_GROUPS or "." in t or any(c in t for c in "*?["),
            f"lora.target_modules: {t!r} is neither a group ({', '.join(LORA_GROUPS)}) nor a module-path "
            "pattern like '*.self_attn.o_proj'; fix the entry",
        )


def _finite_problem(value) -> str | None:
    """A key declared without bounds (``_key(default, help)``) still gets finiteness and int64 checks."""
    from seektrain.config.bounds import Bounds

    return Bounds().problem(value)


def _show(value) -> str:
    return (
        repr(value)
        if isinstance(value, str)
        else json.dumps(value)
        if isinstance(value, list)
        else str(value)
    )


def _check_dist(d) -> None:
    _check(d.backend in ("auto", "nccl", "gloo"), f"dist.backend={d.backend!r}: use auto, nccl or gloo")
    _check(d.collective_timeout_s > 0, "dist.collective_timeout_s must be > 0 seconds")
    _check(d.init_timeout_s > 0, "dist.init_timeout_s must be > 0 seconds")
    _check(
        d.socket_ifname == d.socket_ifname.strip() and "=" not in d.socket_ifname,
        f"dist.socket_ifname={d.socket_ifname!r}: give an interface name such as eth0 (empty = automatic)",
    )
    dist_env_vars(d.env)


def dist_env_vars(items: list[str]) -> dict[str, str]:
    """``dist.env`` as a dict; each item must be NAME=VALUE with an environment-variable name."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        _check(
            bool(sep) and name.isidentifier() and name == name.upper(),
            f"dist.env: {item!r} is not NAME=VALUE with an upper-case variable name, e.g. NCCL_DEBUG=WARN",
        )
        out[name] = value
    return out


def _check_resume(spec: str) -> None:
    """The form of checkpoint.resume only; whether the checkpoint exists is decided at resume time."""
    ok = (
        spec in ("auto", "never")
        or spec.isdigit()
        or "/" in spec
        or (bool(spec.strip()) and Path(spec).expanduser().exists())
    )
    _check(ok, f"checkpoint.resume={spec!r}: use auto, never, a step number or a checkpoint path")


def _check_trackers(cfg: JobConfig) -> None:
    m = cfg.metrics  # unknown names are refused by the key's choices
    _check(
        len(set(m.trackers)) == len(m.trackers), f"metrics.trackers={m.trackers}: a tracker is listed twice"
    )


def config_to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: JobConfig, comments: bool = False) -> str:
    """TOML text that ``load_config`` reads back to an equal config; ``comments`` puts each key's help
    from the schema above it (what ``configs/default.toml`` is)."""
    lines: list[str] = []

    def table(obj, name: str) -> None:  # its own keys first: TOML puts sub-tables after them
        lines.append(f"[{name}]")
        subs = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                subs.append((value, f"{name}.{f.name}"))
                continue
            if comments:
                lines.append(f"# {f.metadata['help']}")
            lines.append(f"{f.name} = {toml_value(value)}")
        lines.append("")
        for sub in subs:
            table(*sub)

    for section_field in dataclasses.fields(cfg):
        table(getattr(cfg, section_field.name), section_field.name)
    return "\n".join(lines)
