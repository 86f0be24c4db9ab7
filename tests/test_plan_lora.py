"""The planner's LoRA model without distributed runs (the measured rows are in test_plan_accuracy.py): the
frozen base's and the adapters' state against hand-computed sizes, what LoRA saves per rank, and
``seektrain plan`` without ``--gpus`` answering "the fewest GPUs (and the host memory)"."""

from __future__ import annotations

import json

from seektrain.cli.main import main
from seektrain.config.loader import load_config
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan import memory
from seektrain.plan.hardware import hardware
from seektrain.plan.run_plan import RunPlan
from seektrain.plan.search import memory_breakdown

BF16 = ["precision.dtype=bf16"]


def _plan(model: str, world: int, *overrides: str, device: str = "cuda") -> RunPlan:
    return RunPlan.resolve(load_config(None, list(overrides)), get_preset(model), world, device)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_lora_state_is_a_frozen_bf16_base_and_adamw_on_the_adapters_only():
    """One rank, adapters on every o_proj (a pattern target): the base is 2 bytes per parameter with no
    gradient or optimizer state; each o_proj gets A [r, heads × v_head_dim] and B [hidden, r], with fp32
    master, gradient, two moments and one step each."""
    r = 8
    plan = _plan("tiny-v3", 1, *BF16, "lora.enabled=true", f"lora.rank={r}", "lora.target_modules=*.o_proj")
    cfg = plan.model
    base = sum(_numel(s.shape) for s in memory.param_specs(cfg))
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers  # MTP blocks have an o_proj too
    per_block = r * cfg.num_attention_heads * cfg.value_head_dim + cfg.hidden_size * r
    adapters, tensors = blocks * per_block, 2 * blocks
    state = memory.state_bytes(plan, 0)
    assert (state.frozen, state.params, state.grads, state.optimizer) == (
        2 * base,
        4 * adapters,
        4 * adapters,
        8 * adapters + 4 * tensors,
    )


def test_lora_cuts_deepseek_v3_state_and_gradient_buffers():
    """The same V3 layout on 64 H100: LoRA's state per rank is the bf16 base share plus small adapter
    state, under a fifth of a full fine-tune's 16 bytes per parameter; FSDP's per-layer buffer holds the
    gathered layer but no base gradients."""
    layout = ["parallel.tp=8", "parallel.dp_shard=8", "train.global_batch_size=64", "train.seq_len=4096"]
    full = _plan("deepseek-v3", 64, *layout)
    lora = _plan("deepseek-v3", 64, *layout, "lora.enabled=true")
    f, lo = memory.max_state_bytes(full), memory.max_state_bytes(lora)
    assert lo.frozen + lo.params + lo.grads + lo.optimizer < (f.params + f.grads + f.optimizer) / 5
    assert lo.params < lo.frozen / 50  # rank-16 adapters are a small share of the base
    assert memory.comm_buffer_bytes(lora).layer < 0.6 * memory.comm_buffer_bytes(full).layer
    h100 = hardware("h100-80g")
    assert memory_breakdown(lora, h100).total < memory_breakdown(full, h100).total


def test_plan_without_gpus_finds_the_fewest_and_the_host_memory(capsys):
    """DeepSeek-V2-Lite on A100-40GB: a full fine-tune needs 2 GPUs with its state offloaded to the host
    (which the report sizes per rank and per node); LoRA fits one GPU with no host memory."""
    common = ["plan", "--model", "deepseek-v2-lite", "--gpu", "a100-40g", "--top", "1", "--json"]
    assert main(common) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*common, "--set", "lora.enabled=true"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert (full["fewest_gpus"], lora["fewest_gpus"]) == (2, 1)
    assert full["gpus"] == 2 and full["global_batch"] == 8  # the default batch follows the count found
    host = full["ranked"][0]["host_memory_gib"]
    assert full["ranked"][0]["settings"]["parallel.cpu_offload"] is True
    assert host["per_rank"] > 60 and host["per_node"] == 2 * host["per_rank"]
    assert lora["ranked"][0]["host_memory_gib"]["per_rank"] == 0
    assert "frozen base (compute dtype, LoRA)" in lora["ranked"][0]["memory_gib"]
    assert lora["precision"].startswith("LoRA r=16")
