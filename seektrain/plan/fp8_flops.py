"""What ``precision.fp8`` converts, counted from the model config alone, for the planner's time model:
``parallel/float8.py`` converts the modules, this counts the weights they hold (tests/test_float8.py holds
the two equal), so the planner needs nothing of parallel/."""

from __future__ import annotations

from seektrain.models.config import ModelConfig

RECIPE_MULTIPLE = {"rowwise": 16, "blockwise": 128}  # torch's FP8 GEMM needs 16; torchao's blockwise layer 128


def _layer_linears(cfg: ModelConfig, layer_idx: int) -> list[tuple[int, int, bool]]:
    """(in, out, bias) of decoder layer ``layer_idx``'s dense linears, as models/ builds them."""
    d, h, b = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    if not cfg.is_mla:
        hd, kv = cfg.head_dim, cfg.num_key_value_heads
        out = [(d, h * hd, b), (d, kv * hd, b), (d, kv * hd, b), (h * hd, d, b)]
    else:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        assert cfg.kv_lora_rank is not None  # an MLA config (cfg.is_mla)
        out = ([(d, h * qk, False)] if cfg.q_lora_rank is None
               else [(d, cfg.q_lora_rank, b), (cfg.q_lora_rank, h * qk, False)])
        out += [(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, b),
                (cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False), (h * cfg.v_head_dim, d, b)]
    hidden = (cfg.intermediate_size if not cfg.is_moe_layer(layer_idx)
              else cfg.moe_intermediate_size * cfg.n_shared_experts)
    if hidden:
        out += [(d, hidden, False), (d, hidden, False), (hidden, d, False)]
    return out


def fp8_matmul_params(cfg: ModelConfig, recipe: str, include_mtp: bool = True, experts: bool = True) -> int:
    """Weights one token multiplies with in FP8 under ``recipe``: the analytic twin of ``float8_targets``
    (tests/test_float8.py holds them equal), for the planner's time model. ``experts`` as there."""
    if recipe == "none":
        return 0
    multiple, total = RECIPE_MULTIPLE[recipe], 0
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0)
    for idx in range(layers):
        for n_in, n_out, bias in _layer_linears(cfg, idx):
            if n_in % multiple == 0 and n_out % multiple == 0 and not (bias and recipe == "blockwise"):
                total += n_in * n_out
        f = cfg.moe_intermediate_size
        if (cfg.is_moe_layer(idx) and experts and recipe == "rowwise" and cfg.hidden_size % 16 == 0
                and f % 16 == 0):
            total += cfg.num_experts_per_tok * 3 * cfg.hidden_size * f
    return total
