"""``train.compile`` compiles every decoder block and trains the same model: fp32 losses of a compiled
tiny run equal the eager run's."""

from __future__ import annotations

import pytest

from run_cli import losses, train


def test_compiled_blocks_train_like_eager(tmp_path):
    common = ("train.steps=3", "model.preset=tiny-dense")
    train(tmp_path / "eager", *common)
    proc = train(tmp_path / "compiled", *common, "train.compile=true")
    assert "train.compile: 4 blocks compile at their first call" in proc.stdout
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5, abs=1e-6)


def test_moe_blocks_do_not_recompile_per_micro_batch():
    """Recording each forward's expert counts must not become a guard of the compiled MoE block (a
    recompile per micro-batch until torch.compile's limit, then eager)."""
    import torch
    from torch._dynamo.utils import counters

    from seektrain.models import build_model, get_preset
    from seektrain.parallel.compile import apply_compile
    from seektrain.platform import policy_for

    torch._dynamo.reset()
    counters.clear()
    cfg = get_preset("tiny-v3").replace(num_nextn_predict_layers=0)
    model = build_model(
        cfg, dtype=torch.bfloat16, seed=0, kernels=policy_for(torch.device("cpu")).model_kernels()
    )
    model.train()
    apply_compile(model)
    graphs = []
    for _ in range(2):  # steps
        for _ in range(6):  # micro-batches, counts piling up between clears as in the trainer
            tokens = torch.randint(
                0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(len(graphs))
            )
            model(tokens, labels=tokens).loss_sum.backward()
            graphs.append(counters["stats"]["unique_graphs"])
        for module in model.modules():
            if hasattr(module, "expert_counts"):
                module.expert_counts.clear()
    assert len(set(graphs[3:])) == 1, graphs  # after warm-up (dense/MoE blocks, dynamic rows): no new graphs
