"""Pipeline parallelism with ``torch.distributed.pipelining``: split the model into stages, place them
on the ``pp`` ranks and build the schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble V).

A stage is the same ``Transformer`` class with the layers it does not own deleted (and the embedding,
final norm, head and MTP modules kept only on the first / last stage), so parameter names — and so
checkpoints — are those of the whole model. With MTP, the first stage also embeds the labels and the
pipeline carries those embeddings to the last stage, where the MTP modules need them; their gradient
flows back through the pipeline to the one embedding table.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleZBVZeroBubble)

from seektrain.config.loader import ConfigError
from seektrain.models.config import ModelConfig
from seektrain.models.layers import rope_cos_sin
from seektrain.models.transformer import Transformer
from seektrain.observe.flops import layer_matmul_params

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}
MULTI_STAGE = ("interleaved-1f1b", "zbv")


def stages_per_rank(schedule: str, interleave: int) -> int:
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    return 2 if schedule == "zbv" else (interleave if schedule == "interleaved-1f1b" else 1)


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """Global stage indices this rank runs: looped (r, r+pp, ...) or V-shaped (r, 2pp-1-r) for zbv."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def layer_costs(cfg: ModelConfig) -> list[float]:
    """Relative compute of each decoder layer: its activated matmul parameters (an MoE layer counts its
    top-k and shared experts, so it weighs more than a dense one)."""
    return [float(layer_matmul_params(cfg, i)) for i in range(cfg.num_hidden_layers)]


def split_layers(cfg: ModelConfig, n_stages: int, manual: list[int] | None = None) -> list[list[int]]:
    """Contiguous layer ranges per stage. Automatic splits minimise the heaviest stage, counting the
    head (+ MTP) on the last stage and the embedding on the first."""
    n = cfg.num_hidden_layers
    if manual:
        if len(manual) != n_stages or sum(manual) != n or min(manual) < 1:
            raise ConfigError(f"parallel.pp_split={manual}: need {n_stages} positive layer counts summing to {n}")
        counts = manual
    else:
        if n_stages > n:
            raise ConfigError(f"{n_stages} pipeline stages but the model has only {n} layers; lower parallel.pp")
        costs = layer_costs(cfg)
        head = cfg.hidden_size * cfg.vocab_size * (1 + cfg.num_nextn_predict_layers)
        head += cfg.num_nextn_predict_layers * max(costs)
        counts = _balanced_counts(costs, n_stages, first_extra=cfg.hidden_size * 2.0, last_extra=float(head))
    bounds, start = [], 0
    for c in counts:
        bounds.append(list(range(start, start + c)))
        start += c
    return bounds


def _balanced_counts(costs: list[float], k: int, first_extra: float, last_extra: float) -> list[int]:
    """Minimise the maximum stage cost over contiguous splits (exact dynamic programme, n·k² small)."""
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
                cost = prefix[j] - prefix[i] + (first_extra if s == 1 else 0.0) + (last_extra if s == k else 0.0)
                value = max(best[s - 1][i], cost)
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts, j = [], n
    for s in range(k, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def _stage_forward(self: Transformer, x: torch.Tensor, extra: torch.Tensor | None = None):
    """Forward of a pipeline stage. First stage: (tokens, labels) -> (h, label embeddings); middle:
    (h, label embeddings) -> same; last: -> (logits, *mtp logits). Without MTP only h travels."""
    use_mtp = self.cfg.num_nextn_predict_layers > 0
    if self.embed_tokens is not None:
        h = self.embed_tokens(x)
        extra = self.embed_tokens(extra) if use_mtp and extra is not None else None
    else:
        h = x
    cos, sin = rope_cos_sin(self.cfg, h.shape[1], h.device, h.dtype)
    for layer in self.layers.values():
        h = layer(h, cos, sin)
    if self.norm is None:
        return (h, extra) if extra is not None else h
    logits = self.lm_head(self.norm(h))
    if extra is None or self.mtp is None or not len(self.mtp):
        return logits
    return (logits, *self.mtp_logits(h, extra, cos, sin))


def build_stage_model(model: Transformer, layers: list[int], first: bool, last: bool) -> Transformer:
    """A copy of the (meta-device) model keeping only what one stage needs."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for key in list(stage.layers.keys()):
        if key not in keep:
            del stage.layers[key]
    if not first:
        stage.embed_tokens = None
    if not last:
        stage.norm, stage.lm_head, stage.mtp = None, None, None
    stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def build_schedule(stage_modules: list[nn.Module], ids: list[int], n_stages: int, device: torch.device,
                   pp_group, schedule: str, n_microbatches: int, loss_fn, world_mesh=None):
    """``world_mesh`` lets a stage rebuild the DTensor activations it receives (tensor parallelism):
    they name their mesh by dimension names, which we look up in the one world mesh."""
    def get_mesh(dim_names, _layout):
        return world_mesh[dim_names if len(dim_names) > 1 else dim_names[0]]

    stages = [PipelineStage(m, i, n_stages, device, group=pp_group,
                            get_mesh=get_mesh if world_mesh is not None else None)
              for m, i in zip(stage_modules, ids)]
    cls = SCHEDULES[schedule]
    if schedule in MULTI_STAGE:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
