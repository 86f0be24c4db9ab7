"""How a pipeline splits the model: schedule names, stages per rank, and the contiguous layer ranges of
every stage, balanced by compute. Pure arithmetic (no torch.distributed), so the run plan and the planner
can use it before any process starts."""

from __future__ import annotations

import functools

from seektrain.config.loader import ConfigError
from seektrain.models.config import ModelConfig
from seektrain.observe.flops import layer_matmul_params

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
MULTI_STAGE = ("interleaved-1f1b", "zbv")  # schedules that run several stages per rank


def stages_per_rank(schedule: str, interleave: int) -> int:
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"parallel.pp_schedule={schedule!r}: use one of {', '.join(SCHEDULE_NAMES)}")
    return 2 if schedule == "zbv" else (interleave if schedule == "interleaved-1f1b" else 1)


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """Global stage indices this rank runs: looped (r, r+pp, ...) or V-shaped (r, 2pp-1-r) for zbv."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


_COSTS: dict[str, list[float]] = {}


def layer_costs(cfg: ModelConfig) -> list[float]:
    """Relative compute of each decoder layer: its activated matmul parameters (an MoE layer counts its
    top-k and shared experts, so it weighs more than a dense one). Cached per config (its ``repr``): the
    planner resolves thousands of pipeline layouts of one model."""
    key = repr(cfg)
    if key not in _COSTS:
        _COSTS[key] = [float(layer_matmul_params(cfg, i)) for i in range(cfg.num_hidden_layers)]
    return list(_COSTS[key])


def split_layers(cfg: ModelConfig, n_stages: int, manual: list[int] | None = None) -> list[list[int]]:
    """Contiguous layer ranges per stage. Automatic splits minimise the heaviest stage, counting the
    head (+ MTP) on the last stage and the embedding on the first."""
    n = cfg.num_hidden_layers
    if manual:
        if len(manual) != n_stages or sum(manual) != n or min(manual) < 1:
            raise ConfigError(
                f"parallel.pp_split={manual}: need {n_stages} positive layer counts summing to {n}"
            )
        counts = tuple(manual)
    else:
        if n_stages > n:
            raise ConfigError(
                f"{n_stages} pipeline stages but the model has only {n} layers; lower parallel.pp"
            )
        costs = layer_costs(cfg)
        head = float(cfg.hidden_size * cfg.vocab_size * (1 + cfg.num_nextn_predict_layers))
        head += cfg.num_nextn_predict_layers * max(costs)
        counts = _balanced_counts(
            tuple(costs), n_stages, first_extra=cfg.hidden_size * 2.0, last_extra=float(head)
        )
    bounds, start = [], 0
    for c in counts:
        bounds.append(list(range(start, start + c)))
        start += c
    return bounds


@functools.lru_cache(maxsize=256)
def _balanced_counts(
    costs: tuple[float, ...], k: int, first_extra: float, last_extra: float
) -> tuple[int, ...]:
    """Minimise the maximum stage cost over contiguous splits (exact dynamic programme, n·k²; cached,
    because the planner resolves thousands of plans with the same few splits)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            for i in range(s - 1, j):
                cost = (
                    prefix[j] - prefix[i] + (first_extra if s == 1 else 0.0) + (last_extra if s == k else 0.0)
                )
                value = max(best[s - 1][i], cost)
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts, j = [], n
    for s in range(k, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return tuple(counts[::-1])
