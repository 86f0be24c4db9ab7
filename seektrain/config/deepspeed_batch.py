"""DeepSpeed's batch-size rule, exactly: train_batch_size = micro × accumulation × data-parallel size.

Why a file of its own: the three DeepSpeed keys map onto two of ours (``train.global_batch_size``,
``train.micro_batch_size``; accumulation is derived by the run plan), and whether a DeepSpeed file can
be imported at all depends on this rule and on the world size. DeepSpeed
(``DeepSpeedConfig._set_batch_related_parameters`` and ``_batch_assertion``) derives the missing value
by floor division and then asserts the product; refusing a product that does not divide is the same
outcome, said in one line.
"""

from __future__ import annotations

from typing import NamedTuple

from seektrain.config.loader import ConfigError

TRAIN, MICRO, ACCUM = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
# The world size is known to `seektrain train` unless its node count is elastic.
WORLD_SIZE_HINT = "pass --world-size N (the number of GPUs; train uses its fixed --nnodes × --nproc-per-node)"


class Batch(NamedTuple):
    train_batch_size: int
    micro_batch_size: int
    accumulation: int | None  # None: left to the run plan (data-parallel size unknown)


def data_parallel_size(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """The ranks that see different data: DeepSpeed's ``world_size`` in its batch rule. Ours honours
    tensor, pipeline and context parallelism (expert parallelism lives inside data parallelism; DeepSpeed
    divides by its sequence_parallel_size the same way)."""
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp × parallel.pp × parallel.cp = "
            f"{tp}×{pp}×{cp}; change the degrees or the number of processes"
        )
    return world_size // (tp * pp * cp)


def resolve_batch(train: int | None, micro: int | None, accum: int | None, dp: int | None) -> Batch:
    """Any two of (train, micro, accum) determine the third; one alone means accumulation 1 (as in
    DeepSpeed). ``dp`` is the data-parallel size, or None when unknown: then only inputs that do not
    need it are accepted, and anything else is refused with one line naming what to add."""
    given = ", ".join(
        f"{k}={v}" for k, v in ((TRAIN, train), (MICRO, micro), (ACCUM, accum)) if v is not None
    )
    if train is None and micro is None:
        raise ConfigError(f"set {TRAIN} or {MICRO} (DeepSpeed needs one of them; got {given or 'neither'})")
    if dp is None:
        if train is not None and micro is not None:
            _check(
                train % (micro * (accum or 1)) == 0,
                f"{given}: {TRAIN} must be a multiple of {MICRO}{' × ' + ACCUM if accum else ''}",
            )
            return Batch(train, micro, accum)
        raise ConfigError(
            f"{given}: the missing batch value depends on the data-parallel size; {WORLD_SIZE_HINT} "
            f"or set both {TRAIN} and {MICRO}"
        )
    if train is not None and micro is not None and accum is not None:
        _check(
            train == micro * accum * dp,
            f"{TRAIN}={train} != {MICRO} × {ACCUM} × data-parallel size = {micro}×{accum}×{dp} = "
            f"{micro * accum * dp}; fix one of them (DeepSpeed refuses this too)",
        )
    elif train is not None and micro is not None:
        _check(
            train % (micro * dp) == 0,
            f"{TRAIN}={train} is not a multiple of {MICRO} × data-parallel "
            f"size = {micro}×{dp}; fix one of them",
        )
        accum = train // (micro * dp)
    elif train is not None:
        accum = accum or 1
        _check(
            train % (accum * dp) == 0,
            f"{TRAIN}={train} is not a multiple of {ACCUM} × data-parallel "
            f"size = {accum}×{dp}; fix one of them",
        )
        micro = train // (accum * dp)
    else:
        assert micro is not None  # not both None (refused above)
        accum = accum or 1
        train = micro * accum * dp
    return Batch(train, micro, accum)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)
