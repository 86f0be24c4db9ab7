"""YaRN overrides on top of a model's own config: how a released (or our own) checkpoint gets a longer
context (``[model.rope_scaling]`` of the job config, ``docs/training.md``).

The overrides are absolute values, not increments, so applying them twice gives the same model: a
resumed run applies them again and compares with its checkpoint's model. The new
``max_position_embeddings`` is always ``factor x original_max_position_embeddings``, which is how every
DeepSeek release writes it (V2/V3: 40 x 4096 = 163840) and what transformers derives a missing factor
from. The checks relate an override to the values it is merged with (``beta_slow=40`` alone is wrong
for a model whose ``beta_fast`` is 32), so they run here, once, where the model is chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig, RopeScaling

FIELDS = tuple(f.name for f in dataclasses.fields(RopeScaling) if f.name != "type")


def with_rope_overrides(
    cfg: ModelConfig, overrides: dict[str, Any], where: str = "model.rope_scaling"
) -> ModelConfig:
    """``cfg`` with the given YaRN fields replaced (keys of ``FIELDS``; an empty dict returns ``cfg``).
    A model without YaRN starts from the defaults of the DeepSeek releases (beta_fast 32, beta_slow 1,
    mscale 1, no mscale_all_dim) with its own max_position_embeddings as the original length. A factor
    of 1 means no scaling. One-line ``UserError`` naming the key for a combination that cannot work."""
    if not overrides:
        return cfg
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise UserError(f"{where}: unknown YaRN field {unknown[0]!r}; use one of {', '.join(FIELDS)}")
    base = cfg.rope_scaling or RopeScaling(original_max_position_embeddings=cfg.max_position_embeddings)
    rs = dataclasses.replace(base, **overrides)
    given = ", ".join(f"{k}={v}" for k, v in overrides.items())

    def check(ok: bool, key: str, problem: str) -> None:
        if not ok:
            source = "given" if key in overrides else f"the model's, with {given}"
            raise UserError(f"{where}.{key}={getattr(rs, key)} ({source}): {problem}")

    check(rs.factor >= 1, "factor", "must be >= 1 (1 = no scaling); YaRN only lengthens the context")
    check(rs.original_max_position_embeddings > 0, "original_max_position_embeddings", "must be > 0")
    check(rs.beta_slow > 0, "beta_slow", "must be > 0")
    check(
        rs.beta_fast > rs.beta_slow,
        "beta_fast",
        f"must be > beta_slow={rs.beta_slow} (the releases use beta_fast=32, beta_slow=1)",
    )
    check(rs.mscale >= 0, "mscale", "must be >= 0")
    check(rs.mscale_all_dim >= 0, "mscale_all_dim", "must be >= 0 (0 = off)")
    max_positions = round(rs.factor * rs.original_max_position_embeddings)
    return cfg.replace(
        rope_scaling=rs if rs.factor > 1 else None, max_position_embeddings=max_positions
    ).validate()
