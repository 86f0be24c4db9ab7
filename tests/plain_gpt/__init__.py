"""A second model family that is not DeepSeek (a plain GPT), registered from outside the package through
the registry's public entry: importing this package is its one registration."""

from __future__ import annotations

from plain_gpt import costs
from plain_gpt.config import ARCH, GPTConfig
from plain_gpt.model import PlainGPT
from plain_gpt.shapes import gpt_weights
from seektrain.errors import UserError
from seektrain.models.registry import FamilyCosts, ModelFamily, PipelineRules, register_family

PRESETS = {"gpt-tiny": GPTConfig}


def _no_hf(*args) -> None:
    raise UserError("the plain GPT has no Hugging Face format")


FAMILY = register_family(
    ModelFamily(
        name="plain-gpt",
        config_class=GPTConfig,
        archs=(ARCH,),
        hf_architectures=(),
        module_class=PlainGPT,
        weights=gpt_weights,
        tp_plan="plain_gpt.tp_plan:gpt_tp_plan",
        pipeline=PipelineRules(
            layers="layers",
            first=("embed_tokens", "embed_positions"),
            last=("norm", "lm_head"),
            blocks=("layers",),
        ),
        keep_fp32=lambda model: None,  # LayerNorm and the tables train in the compute dtype
        load_hf=_no_hf,
        costs=FamilyCosts(
            attention_bytes=costs.attention_bytes,
            selective_attention_bytes=costs.selective_attention_bytes,
            dense_mlp_bytes=costs.dense_mlp_bytes,
            moe_bytes=costs.no_moe,
            selective_moe_bytes=costs.no_moe,
            replicated_norm_width=lambda cfg: 0,
            routed_experts=lambda cfg: 0,
            expert_matmul_shape=costs.none,
            tp_summed_outputs=lambda block: [],
            is_moe_block=lambda block: False,
        ),
        presets=PRESETS,
    )
)
