"""Selective activation checkpointing (``train.activation_checkpoint=selective``) is the same computation
as no checkpointing, keeps exactly what the planner says it keeps, and composes with tensor and expert
parallelism. fp32 runs compared with one process through compare_runs.py; memory ordering against "none"
and "full" is measured in test_plan_accuracy.py."""

from __future__ import annotations

import pytest
import torch

from compare_runs import EXACT, assert_same_run, run_layout
from seektrain.config.loader import ConfigError, load_config
from seektrain.models.deepseek.presets import get_preset
from test_float8 import cpu_fp8  # noqa: F401 (fixture)

SELECTIVE = "train.activation_checkpoint=selective"


def test_selective_one_process_matches_no_checkpointing(tmp_path, one_process_run):
    """Bit-identical through the trainer: recomputation replays the same kernels on the same inputs, and
    the kept matmul outputs are the forward's own."""
    got = run_layout(tmp_path, "tiny-v3", 1, SELECTIVE)
    assert_same_run(got, one_process_run("tiny-v3"), EXACT)


def test_selective_tensor_parallel_matches_one_process(tmp_path, one_process_run):
    """TP=2 with sequence parallelism: the all-gathers and reduce-scatters inside each layer are kept by the
    checkpoint and handed back to its recomputation."""
    got = run_layout(tmp_path, "tiny-v3", 2, "parallel.tp=2", "parallel.dp_shard=1", SELECTIVE)
    assert_same_run(got, one_process_run("tiny-v3"))


def test_selective_expert_parallel_with_fsdp_matches_one_process(tmp_path, one_process_run):
    """FSDP=2 × EP=2: the experts are an FSDP unit inside each checkpointed layer, whose hooks open one more
    profiler range during recomputation than in the forward (seektrain/parallel/activation_checkpoint.py,
    ``ignore_profiler_ops``); the all-to-alls are kept."""
    got = run_layout(tmp_path, "tiny-v3", 2, "parallel.ep=2", SELECTIVE)
    assert_same_run(got, one_process_run("tiny-v3"))


def test_policy_keeps_matmuls_attention_and_collectives():
    from torch.utils.checkpoint import CheckpointPolicy

    from seektrain.parallel.activation_checkpoint import selective_policy

    ops = torch.ops
    kept = [
        ops.aten.mm.default,
        ops.aten.addmm.default,
        ops.aten.bmm.default,
        ops.aten._grouped_mm.default,
        ops.aten._scaled_mm.default,
        ops.aten._scaled_dot_product_flash_attention.default,
        ops.aten._scaled_dot_product_efficient_attention.default,
        ops.aten._scaled_dot_product_cudnn_attention.default,
        ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        ops._c10d_functional.all_gather_into_tensor.default,
        ops._c10d_functional.reduce_scatter_tensor.default,
        ops._c10d_functional.all_to_all_single.default,
    ]
    recomputed = [
        ops.aten.mul.Tensor,
        ops.aten.silu.default,
        ops.aten.rsqrt.default,
        ops.aten.add.Tensor,
        ops.aten._to_copy.default,
        ops.aten.topk.default,
        ops._c10d_functional.wait_tensor.default,
    ]
    assert all(selective_policy(None, op) == CheckpointPolicy.MUST_SAVE for op in kept)
    assert all(selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE for op in recomputed)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-v3"])
def test_kept_bytes_equal_the_planner_model(preset):
    """What one selectively checkpointed layer holds after its forward (MemTracker: its input, the outputs
    of its matmuls, attention kernel and nothing else) is ``memory.layer_selective_bytes`` exactly; the CPU
    value padding of MLA attention is on (as the planner assumes on CPU), the expert row padding off (it
    depends on the routing)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from seektrain.models import build_model
    from seektrain.models.kernels import Kernels
    from seektrain.models.layers import rope_cos_sin
    from seektrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from seektrain.plan.memory import layer_selective_bytes
    from seektrain.platform.cpu_kernels import value_padded_attention

    cfg = get_preset(preset)
    model = build_model(cfg, kernels=Kernels(attention=value_padded_attention))
    assert apply_activation_checkpointing(model, "selective") == cfg.num_hidden_layers
    B, T = 2, 64
    cos, sin = rope_cos_sin(cfg, T, "cpu", torch.float32)
    for key, layer in model.layers.items():
        x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
        tracker = MemTracker()
        tracker.track_external(layer)
        with tracker:
            y = layer(x, cos, sin)
            now = next(iter(tracker.get_tracker_snapshot("current").values()))
        kept = (
            sum(v for k, v in now.items() if str(k).endswith(("ACT", "TEMP"))) - y.numel() * y.element_size()
        )
        want = layer_selective_bytes(cfg, int(key), 4, 1, 1, pad_values=True).kept * B * T
        assert abs(kept - want) <= 64, (
            f"{preset} layer {key}: kept {kept} bytes, planner {want:.0f}"
        )  # 64: MoE counts
        y.sum().backward()


def test_selective_with_fp8_gives_the_gradients_of_no_checkpointing(cpu_fp8):  # noqa: F811 (fixture)
    """precision.fp8=rowwise (torchao's FP8 linears, CPU ``_scaled_mm``) under bf16 autocast: a selective
    checkpoint replays the kept matmul outputs and absmax scales, so loss and every gradient are
    bit-identical to the same FP8 model without checkpointing."""
    import copy
    import dataclasses

    from seektrain.models import build_model
    from seektrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from seektrain.parallel.float8 import apply_float8

    model = build_model(dataclasses.replace(get_preset("tiny-dense"), num_hidden_layers=2), seed=1)
    apply_float8(model, "rowwise", experts=False)
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    for mode in ("none", "selective"):
        m = copy.deepcopy(model)
        apply_activation_checkpointing(m, mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(tokens, labels=tokens).loss_sum / tokens.numel()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in m.parameters()]))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def test_selective_is_a_valid_key_and_refused_under_zero_bubble_v():
    from seektrain.plan.run_plan import RunPlan

    job = load_config(None, [SELECTIVE, "parallel.pp=2", "parallel.dp_shard=1", "train.micro_batch_size=2"])
    RunPlan.resolve(job, get_preset("tiny-v3"), 2)  # 1f1b
    job.parallel.pp_schedule = "zbv"
    with pytest.raises(ConfigError, match="selective cannot run under parallel.pp_schedule=zbv"):
        RunPlan.resolve(job, get_preset("tiny-v3"), 2)
    with pytest.raises(ConfigError, match="use none, full, selective or every:K"):
        load_config(None, ["train.activation_checkpoint=partial"])
