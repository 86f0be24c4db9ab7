"""Total and activated parameter counts, computed from a model built on the meta device.

"Activated" is what one token computes with: every weight except the routed experts it is not sent to
and the input embedding table (a lookup reads one row of it). Both counts leave out the MTP modules.
These are the conventions of the published sizes: DeepSeek-V3 671B total / 37B activated, V2 236B / 21B,
V2-Lite 15.7B / 2.4B.
"""

from __future__ import annotations

from dataclasses import dataclass

from seektrain.models import GroupedExperts
from seektrain.models.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    mtp: int


def count_params(cfg: ModelConfig) -> ParamCounts:
    from seektrain.models import Transformer, build_model

    model = build_model(cfg, device="meta")
    assert isinstance(model, Transformer)  # the DeepSeek family's module: ``mtp``, ``embed_tokens``
    mtp = sum(p.numel() for p in model.mtp.parameters())
    total = sum(p.numel() for p in model.parameters()) - mtp
    inactive = 0
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and not name.startswith("mtp."):
            per_expert = sum(p.numel() for p in module.parameters()) // cfg.n_routed_experts
            inactive += per_expert * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    embedding = model.embed_tokens.weight.numel()
    return ParamCounts(total=total, active=total - inactive - embedding, mtp=mtp)
