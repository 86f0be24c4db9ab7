"""Per-layer MoE health (seektrain/train/balance.py: RouterEntropy, layer_table, layer_metrics): the
values on hand-built counts, a planted collapsed router showing in them, and the exported names. The
sinks (metrics.jsonl, TensorBoard, Prometheus) are checked in test_observe_sink.py, a real tiny-v3 run
in test_train_cli.py and test_observe_training_run.py, the alert rule in deploy/prometheus/alerts_test.yml
(test_observe_prometheus.py), the dashboard in test_observe_dashboard.py."""

from __future__ import annotations

import math

import pytest
import torch

from seektrain.models.deepseek.presets import get_preset
from seektrain.models.deepseek.transformer import Transformer
from seektrain.observe.names import EXPORTED_METRICS, LAYER_KEYS, layer_key, metric_name, split_layer_key
from seektrain.train.balance import (
    RouterEntropy,
    collect_expert_load,
    layer_metrics,
    layer_table,
    moe_layer_ids,
    moe_layers,
)


def tiny(preset: str = "tiny-v3") -> tuple[Transformer, object]:
    torch.manual_seed(0)
    cfg = get_preset(preset)
    model = Transformer(cfg)
    model.init_weights()
    return model.train(), cfg


def metrics_of(model, cfg, loads, entropy) -> dict[str, float]:
    table = layer_table(model, loads, entropy, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
    return layer_metrics(table.flatten().tolist())


def test_layer_ids_follow_the_checkpoints_numbering():
    model, cfg = tiny()
    # layer 0 is dense (first_k_dense_replace=1); the MTP block's MoE is layer num_hidden_layers + 0
    assert moe_layer_ids(model, cfg.num_hidden_layers) == [1, 2, 3, 4]


def test_values_on_hand_built_counts():
    model, cfg = tiny()
    biases = [m.gate.e_score_correction_bias for m in moe_layers(model)]
    biases[1].copy_(torch.tensor([0.5, -0.25, 0, 0, 0, 0, 0, 0.1]))
    loads = [
        torch.full((8,), 4.0),  # layer 1: balanced
        torch.tensor([10.0, 2, 2, 2, 2, 2, 2, 2]),  # layer 2: expert 0 takes 10 of 24 slots
        torch.zeros(8),  # layer 3: no token this step
        torch.tensor([8.0, 8, 0, 0, 0, 0, 0, 0]),  # the MTP layer: every token on experts 0 and 1
    ]
    entropy = torch.tensor([[2 * math.log(8), 2], [3.0, 3], [0, 0], [0.5, 4]])
    got = metrics_of(model, cfg, loads, entropy)
    want = {
        1: (1.0, 1 / 8, math.log(8), 0.0),
        2: (10 / 3, 10 / 24, 1.0, 0.75),
        3: (1.0, 0.0, 0.0, 0.0),
        4: (4.0, 0.5, 0.125, 0.0),
    }
    assert set(got) == {layer_key(k, layer) for k in LAYER_KEYS for layer in want}
    for layer, (ratio, share, ent, spread) in want.items():
        assert got[layer_key("moe_load_max_over_mean", layer)] == pytest.approx(ratio)
        assert got[layer_key("moe_top_expert_share", layer)] == pytest.approx(share)
        assert got[layer_key("moe_router_entropy", layer)] == pytest.approx(ent)
        assert got[layer_key("moe_bias_spread", layer)] == pytest.approx(spread)
    # a V2 model has no balancing bias: no bias key; its dense first layer has no row either
    v2, v2_cfg = tiny("tiny-v2")
    n = len(moe_layers(v2))
    got = metrics_of(v2, v2_cfg, [torch.full((v2_cfg.n_routed_experts,), 1.0)] * n, torch.ones(n, 2))
    assert got and not any(k.startswith("moe_bias_spread") for k in got)


def test_a_planted_collapsed_router_shows():
    """A bias that makes every token pick expert 0 in layer 2: its busiest expert takes every token, so
    its share of the slots is 1/k and max/mean is E/k; the other layers stay well below. A router whose
    scores put all mass on one expert has entropy 0, a uniform one log(E)."""
    model, cfg = tiny()
    entropy = RouterEntropy(model)
    moe_layers(model)[1].gate.e_score_correction_bias[0] = 100.0  # layer 2
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    with torch.no_grad():
        model(tokens, mtp_tokens=tokens)
    got = metrics_of(model, cfg, collect_expert_load(model, None), entropy.take(None))
    k, experts = cfg.num_experts_per_tok, cfg.n_routed_experts
    assert got[layer_key("moe_top_expert_share", 2)] == pytest.approx(1 / k)
    assert got[layer_key("moe_load_max_over_mean", 2)] == pytest.approx(experts / k)
    assert got[layer_key("moe_bias_spread", 2)] == pytest.approx(100.0)
    for layer in (1, 3, 4):
        assert got[layer_key("moe_load_max_over_mean", layer)] < experts / k - 1  # 3 is the alert's line
        assert 0.9 * math.log(experts) < got[layer_key("moe_router_entropy", layer)] <= math.log(experts)

    router = moe_layers(model)[0].gate
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 1.0  # on an all-10 input: expert 0 scores sigmoid(+large) = 1, the others 0
        router.weight[1:] = -1.0
        router(torch.full((5, cfg.hidden_size), 10.0))  # a forward outside the model counts as well
    assert entropy.take(None)[0].tolist() == pytest.approx([0.0, 5.0], abs=1e-4)


def test_only_training_forwards_count():
    """Not an evaluation forward, nor activation checkpointing's recomputation in backward."""
    from seektrain.parallel.activation_checkpoint import apply_activation_checkpointing

    model, cfg = tiny()
    assert apply_activation_checkpointing(model, "full") > 0
    entropy = RouterEntropy(model)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    model.eval()
    with torch.no_grad():
        model(tokens, mtp_tokens=tokens)
    assert entropy.take(None).sum().item() == 0
    model.train()
    out = model(tokens, mtp_tokens=tokens)
    (out.logits.sum() + out.mtp[0].sum()).backward()
    assert entropy.take(None)[:, 1].tolist() == [16.0] * 4  # one forward's tokens per layer, MTP's too


def test_names_of_the_layer_metrics():
    assert split_layer_key("moe_router_entropy/layer12") == ("moe_router_entropy", "12")
    assert split_layer_key("loss/layer1") is None and split_layer_key("moe_router_entropy") is None
    assert {metric_name(k) for k in LAYER_KEYS} <= EXPORTED_METRICS
