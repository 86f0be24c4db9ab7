"""``train.compile`` compiles every decoder block and trains the same model: fp32 losses of a compiled
tiny run equal the eager run's, with context parallelism too (the ring inside each compiled block)."""

from __future__ import annotations

import pytest
import torch

from compare_runs import FP32
from run_cli import losses, train


def test_compiled_blocks_train_like_eager(tmp_path):
    common = ("train.steps=3", "model.preset=tiny-dense")
    train(tmp_path / "eager", *common)
    proc = train(tmp_path / "compiled", *common, "train.compile=true")
    assert "train.compile: 4 blocks compile at their first call" in proc.stdout
    # fused kernels round at other points: a 3-step AdamW trajectory, the layout tests' loss tolerance
    want = losses(tmp_path / "eager")
    assert losses(tmp_path / "compiled") == pytest.approx(want, rel=FP32.loss_rel, abs=FP32.loss_abs)


def test_moe_blocks_do_not_recompile_per_micro_batch():
    """Recording each forward's expert counts must not become a guard of the compiled MoE block (a
    recompile per micro-batch until torch.compile's limit, then eager)."""
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


@pytest.mark.slow
def test_compiled_blocks_under_cp2_train_like_one_eager_process(tmp_path):
    """``train.compile`` with ``parallel.cp=2`` (2 ranks, the ring in every attention layer) equals one
    eager process: losses, gradient norms, every parameter (fp32; tiny-dense, since the routed experts'
    grouped GEMM compiles in bf16 only)."""
    from compare_runs import assert_same_run, run_layout

    want = run_layout(tmp_path / "eager", "tiny-dense", 1, steps=2)
    got = run_layout(tmp_path / "compiled", "tiny-dense", 2, "parallel.cp=2", "train.compile=true", steps=2)
    assert_same_run(got, want)


@pytest.fixture
def fake_cp_mesh():
    """A 2-rank ``cp`` mesh on torch's fake process group (no peers, no communication): enough to trace
    the ring's collectives."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # an earlier in-process run left its world of one behind
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def test_ring_traces_into_one_graph_per_block(fake_cp_mesh):
    """A decoder block with the ring (tiny-v3's dense MLA block) compiles into one graph (fullgraph: no
    graph break, forward and the Function's backward) that later calls reuse, and its hops are counted
    (``ring_attention`` counts a compiled call's hops on a host tensor the graph updates: a Python int
    there was a side effect torch.compile refused inside the Function, and a guard outside it)."""
    from torch._dynamo.utils import counters

    from seektrain.models import build_model, get_preset
    from seektrain.parallel import ring_attention as ring
    from seektrain.parallel.context_parallel import apply_context_parallel

    torch._dynamo.reset()
    counters.clear()
    compiled_hops = int(ring._compiled_hops)
    cfg = get_preset("tiny-v3").replace(num_nextn_predict_layers=0)
    model = build_model(cfg, seed=0)
    assert apply_context_parallel(model, fake_cp_mesh) == cfg.num_hidden_layers
    model.layers["0"].compile(fullgraph=True, backend="eager")
    positions = torch.arange(16).view(1, 16)  # this rank's two chunks of a 32-token row
    documents = torch.tensor([[0] * 5 + [1] * 11])
    for _ in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (1, 16))
        model(tokens, labels=tokens, positions=positions, document_ids=documents).loss_sum.backward()
    assert counters["stats"]["unique_graphs"] == 1
    cp = fake_cp_mesh.size()
    assert (
        int(ring._compiled_hops) - compiled_hops
        == 3 * ring.hops_per_call(cp, backward=True)
        == 3 * (3 * cp - 2)
    )
