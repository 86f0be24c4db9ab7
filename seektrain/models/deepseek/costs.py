"""The DeepSeek family's cost hooks (``models/registry.py``, ``FamilyCosts``): what the memory planner
(``plan/memory.py``, ``plan/lora_memory.py``), the FLOP counter (``observe/flops.py``), the layout checks
(``plan/layout_checks.py``, ``plan/search.py``) and the TP plan (``parallel/tensor_parallel.py``) need to
know of MLA and DeepSeekMoE, so that generic code reads no MLA or MoE field of the config.

The activation terms are bytes per token of one tensor-parallel rank (``tp`` ranks, ``a`` bytes per element
of the compute dtype, before sequence parallelism's split), for the tensors our modules save for backward;
``tests/test_plan_accuracy.py`` compares their sum with ``MemTracker``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.moe import MoE

FP32 = 4


def _swiglu(width: float, a: int) -> float:
    """gate and up outputs, silu(gate), and the product down_proj keeps (``plan/memory.py``'s rule)."""
    return 4 * a * width


def dense_mlp_bytes(cfg: ModelConfig, a: int, tp: int) -> float:
    """A dense layer's SwiGLU MLP (its intermediate features split over ``tp``)."""
    return _swiglu(cfg.intermediate_size / tp, a)


def attention_bytes(cfg: ModelConfig, a: int, tp: int, pad_values: bool, ring: bool) -> float:
    """Bytes per token saved by attention (after its input norm): flash attention keeps q, k, v, the
    output and the fp32 log-sum-exp; o_proj keeps its (re-laid-out) input; MLA adds its low-rank
    latents (the fp32 norm input, the normed value, and the projections' inputs). ``ring``: context
    parallelism's ring attention (``parallel/ring_attention.py``) keeps its inputs q, k, v and its output
    as they are (the compute dtype, values unpadded: it pads them again in backward) and the log-sum-exp;
    o_proj keeps the output re-laid-out. ``pad_values``: the CPU flash kernel gets values zero-padded to
    the query/key head size."""
    h = cfg.num_attention_heads / tp
    lse = FP32 * h
    qk = cfg.qk_head_dim
    v = cfg.value_head_dim
    if ring:
        kernel = a * h * (2 * qk + 2 * v) + a * h * v + lse
    elif not cfg.is_mla:
        return a * h * qk * 5 + lse  # q, k and v (GQA expanded), output, o_proj input
    else:
        v_kernel = qk if pad_values and v < qk else v
        kernel = a * h * (2 * qk + 2 * v_kernel + v) + lse
    if not cfg.is_mla:
        return kernel
    assert cfg.kv_lora_rank is not None  # an MLA config (cfg.is_mla)
    low_rank = (FP32 + 2 * a) * cfg.kv_lora_rank + a * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    if cfg.q_lora_rank is not None:
        low_rank += (FP32 + 2 * a) * cfg.q_lora_rank + a * cfg.q_lora_rank
    return low_rank + kernel


def selective_attention_bytes(cfg: ModelConfig, a: int, tp: int, pad_values: bool) -> float:
    """What a selectively checkpointed attention keeps per token, o_proj's output aside (the caller's
    row-wise output): the projections' outputs, the kernel's output and its fp32 log-sum-exp."""
    h = cfg.num_attention_heads / tp
    v_kernel = cfg.value_head_dim
    if pad_values and v_kernel < cfg.qk_head_dim:
        v_kernel = cfg.qk_head_dim  # the CPU flash kernel gets values zero-padded to qk (attention_bytes)
    kernel = a * h * v_kernel + FP32 * h
    if cfg.is_mla:  # the low-rank projections are replicated under TP, the up-projections split by head
        assert cfg.kv_lora_rank is not None
        latents = cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.q_lora_rank or 0)
        projections = a * latents + a * h * (cfg.qk_head_dim + cfg.qk_nope_head_dim + cfg.v_head_dim)
    else:
        projections = a * (h + 2 * cfg.num_key_value_heads / tp) * cfg.head_dim
    return projections + kernel


def moe_bytes(cfg: ModelConfig, a: int, tp: int, ep: int) -> float:
    """A MoE layer's MLP: router scores (fp32), and per routed slot the dispatched token, the grouped
    SwiGLU's tensors and the weighted output; the shared experts like a dense SwiGLU. Under TP without EP
    each rank computes the slots of its E/tp experts."""
    k = cfg.num_experts_per_tok / tp  # TP: E/tp experts per rank; TP×EP: each tp rank its share of tokens
    router = 2 * FP32 * cfg.n_routed_experts
    routed = k * (
        2 * a * cfg.hidden_size + _swiglu(cfg.moe_intermediate_size, a) + a * cfg.moe_intermediate_size
    )
    shared = _swiglu(cfg.n_shared_experts * cfg.moe_intermediate_size / tp, a)
    return router + routed + shared


def selective_moe_bytes(cfg: ModelConfig, a: int, tp: int, ep: int) -> tuple[float, float]:
    """(kept, its tail) of a selectively checkpointed MoE layer's MLP: the router's fp32 logits, per
    routed slot the grouped gate/up and down outputs (and, under EP, the dispatched slot and the returned
    result, both all-to-all outputs), the shared experts like a dense MLP, under TP the reduce-scattered
    block output."""
    d = cfg.hidden_size
    k = cfg.num_experts_per_tok / tp
    kept = (
        FP32 * cfg.n_routed_experts
        + k * a * (2 * cfg.moe_intermediate_size + d)
        + (2 * k * a * d if ep > 1 else 0)
    )
    reduced = a * d / tp if tp > 1 else 0.0  # the block's partial output, reduce-scattered
    if not cfg.n_shared_experts:
        return kept + reduced, reduced
    shared = 2 * a * cfg.n_shared_experts * cfg.moe_intermediate_size / tp + a * d
    return kept + shared + reduced, a * d + reduced


def replicated_norm_width(cfg: ModelConfig) -> int:
    """Width per token of the norms inside one decoder block that TP replicates (MLA's q_a/kv_a norms);
    the residual norms are sequence-sharded and not counted here."""
    return (cfg.kv_lora_rank or 0) + (cfg.q_lora_rank or 0) if cfg.is_mla else 0


def routed_experts(cfg: ModelConfig) -> int:
    """The routed experts expert parallelism splits (0: a dense model)."""
    return cfg.n_routed_experts


def expert_matmul_shape(cfg: ModelConfig, tokens: int) -> tuple[int, int, int] | None:
    """The ``(m, k, n)`` of one routed expert's up-projection for ``tokens`` rows (its share of the
    slots), or None for a dense model."""
    if not cfg.n_routed_experts:
        return None
    per_expert = max(1, tokens * cfg.num_experts_per_tok // cfg.n_routed_experts)
    return (per_expert, cfg.hidden_size, cfg.moe_intermediate_size)


def tp_summed_outputs(block: nn.Module) -> list[tuple[nn.Module, int]]:
    """The modules of a decoder block whose output columns from ``start`` on are shared by every head:
    under TP each rank's heads contribute only part of their gradient, which is summed over the tp group.
    MLA: the decoupled RoPE key, the last columns of ``kv_a_proj_with_mqa``'s output."""
    attn: Any = block.self_attn
    if hasattr(attn, "kv_a_proj_with_mqa"):
        return [(attn.kv_a_proj_with_mqa, attn.kv_lora_rank)]
    return []


def is_moe_block(block: nn.Module) -> bool:
    """Whether a decoder block's MLP is a DeepSeekMoE layer (TP gives it ``MoETensorParallel``)."""
    return isinstance(block.mlp, MoE)
