"""FLOPs per token: a hand count, torch's FLOP counter on real tiny models, hardware peaks and MFU."""

from __future__ import annotations

import time

import pytest
import torch

from seektrain.models import build_model, get_preset
from seektrain.observe.counting import ModuleFlopCounter
from seektrain.observe.flops import (
    active_matmul_params,
    attention_flops_per_token,
    gpu_peak_from_name,
    mfu,
    model_flops_per_token,
    peak_flops,
)
from seektrain.observe.profiler import flops_breakdown, format_flops_table


def test_tiny_dense_hand_count_and_mfu():
    cfg = get_preset("tiny-dense")  # d=128, ffn=352, 4 layers, 4 heads of 32, 2 KV heads, vocab 320
    # attention: q 128*128 + k 128*64 + v 128*64 + o 128*128          = 49_152
    # MLP:       gate, up, down 3 * 128*352                            = 135_168
    # per layer 184_320, x4 layers                                     = 737_280
    # LM head    128*320                                               = 40_960   (embedding: a lookup)
    n_active = 4 * (128 * 128 + 128 * 64 + 128 * 64 + 128 * 128 + 3 * 128 * 352) + 128 * 320
    assert n_active == 778_240 == active_matmul_params(cfg)
    # attention scores at T=64, causal: 3 x layers x heads x (qk 32 + v 32) x T = 3*4*4*64*64 = 196_608
    assert attention_flops_per_token(cfg, 64) == 196_608
    per_token = 6 * 778_240 + 196_608
    assert per_token == 4_866_048 == model_flops_per_token(cfg, 64)
    # 1M tokens/s on a 10 TFLOP/s device: 4.866048e12 / 1e13
    assert mfu(1e6, per_token, 1e13) == pytest.approx(0.4866048)
    assert mfu(1e6, per_token, 0.0) == 0.0


def _train_step_flops(name: str, batch: int, seq: int) -> tuple[int, dict]:
    """(total FLOPs of one forward + backward, FLOPs by module path) from the executed ops."""
    cfg = get_preset(name)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    counter = ModuleFlopCounter(model)
    with counter:
        out = model(tokens, mtp_tokens=tokens if cfg.num_nextn_predict_layers else None)
        logits, mtp = out.logits, out.mtp
        loss = logits.float().mean() + sum(x.float().mean() for x in mtp)
        loss.backward()
    return counter.total, dict(counter.flops)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-v2", "tiny-v3"])
def test_analytic_count_matches_flop_counter(name):
    """Our counter (torch's formulas plus ours for _grouped_mm and the CPU flash kernel) counts attention
    without the causal mask, so the comparison uses causal=False. The MoE routes every token to exactly
    top-k experts and grouped_mm multiplies only the routed rows, so the MoE count is exact as well. The
    model has the default kernels: no value padding in MLA attention, no padded expert rows."""
    batch, seq = 2, 64
    cfg = get_preset(name)
    counted, by_module = _train_step_flops(name, batch, seq)
    expected = model_flops_per_token(cfg, seq, causal=False) * batch * seq
    assert counted == pytest.approx(expected, rel=1e-3), by_module
    if cfg.is_moe:  # the routed experts run as _grouped_mm, which torch's counter alone reads as 0 FLOPs
        assert any(path.endswith(".experts") and flops > 0 for path, flops in by_module.items()), by_module


def test_mtp_and_causal_switches():
    cfg = get_preset("tiny-v3")
    with_mtp, without = model_flops_per_token(cfg, 128), model_flops_per_token(cfg, 128, include_mtp=False)
    assert with_mtp > without
    assert attention_flops_per_token(cfg, 128, causal=False) == 2 * attention_flops_per_token(cfg, 128)


def test_deepseek_v3_active_params_near_published():
    # 37B activated (without MTP, embedding excluded): the analytic count lands within a few percent.
    n = active_matmul_params(get_preset("deepseek-v3"), include_mtp=False)
    assert 35e9 < n < 39e9


def test_flops_breakdown_attributes_backward_to_the_right_module():
    cfg = get_preset("tiny-v3")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    rows = {r.module: r for r in flops_breakdown(model, tokens, labels=tokens)}
    assert rows[""].flops == pytest.approx(model_flops_per_token(cfg, 32, causal=False) * 64, rel=0.02)
    assert rows["embed_tokens"].flops == 0
    # the shared head runs for the main output and the MTP depth: 2 x 6 x d x V per token
    assert rows["lm_head"].flops == 2 * 6 * cfg.hidden_size * cfg.vocab_size * 64
    for name, row in rows.items():  # every matmul's backward is twice its forward
        assert row.flops == 3 * row.forward_flops, name
    assert all(p.grad is None for p in model.parameters())
    table = format_flops_table(list(rows.values()), depth=1)
    assert "lm_head" in table and "layers" in table and "self_attn" not in table


@pytest.mark.parametrize(
    "name,dtype,tf32,tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4),
        ("NVIDIA H100 PCIe", torch.float16, False, 756.0),
        ("NVIDIA H200", torch.bfloat16, False, 989.4),
        ("NVIDIA H800", torch.bfloat16, False, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156.0),
        ("NVIDIA A100-PCIE-40GB", torch.float32, False, 19.5),
        ("NVIDIA A800-SXM4-80GB", torch.bfloat16, False, 312.0),
        ("NVIDIA L40S", torch.bfloat16, False, 362.05),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, False, 165.2),
        ("Tesla V100-SXM2-32GB", torch.float16, False, 125.0),
    ],
)
def test_gpu_peak_table(name, dtype, tf32, tflops):
    flops, source = gpu_peak_from_name(name, dtype, tf32)
    assert flops == pytest.approx(tflops * 1e12)
    assert source.startswith("datasheet")


def test_unknown_gpu_has_no_table_entry():
    assert gpu_peak_from_name("NVIDIA T4", torch.bfloat16, False) is None


def test_cpu_peak_is_measured_once_per_process():
    flops, source = peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 1e8 and "measured" in source and "threads" in source
    start = time.perf_counter()
    again, _ = peak_flops("cpu", torch.float32)
    assert again == flops and time.perf_counter() - start < 0.05
