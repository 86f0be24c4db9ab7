"""The planner under context parallelism (``parallel.cp``), without distributed runs: every per-token
memory term is per cp rank, the ring adds its key/value chunks, parameters shard over ``dp_shard × cp``,
the ring's transfers show only where attention cannot hide them, the search tries cp for long sequences
(and picks it for DeepSeek-V3 at 128K), and plans without cp are what they were."""

from __future__ import annotations

import pytest
import torch

from seektrain.config.loader import load_config
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan import memory
from seektrain.plan.hardware import GPUS
from seektrain.plan.run_plan import RunPlan
from seektrain.plan.search import cp_degrees
from seektrain.plan.speed import step_time

GIB = 2**30


def _plan(model: str, world: int, *overrides: str) -> RunPlan:
    job = load_config(None, ["train.micro_batch_size=1", *overrides])
    return RunPlan.resolve(job, get_preset(model), world, "cuda")


LONG = ("train.seq_len=16384", "train.global_batch_size=8")


@pytest.mark.parametrize("mode", ["none", "full"])
def test_activations_are_the_cp_ranks_share_of_the_sequence(mode):
    """Every per-token term of cp=2 is half of cp=1's with the ring's attention (cp=4: a quarter), to the
    byte; the ring's transients (CUDA: MLA's values unpadded, the memory-efficient kernel) are 2 bf16
    [k | v] chunks (192 + 128 per MLA head), 3 fp32 dK/dV chunks and the fp32 dQ, less the MLP tensors
    freed before them; packed documents add a bf16 [c, c] bias, c = seq_len / (2·cp)."""
    ckpt = f"train.activation_checkpoint={mode}"
    two_plan = _plan("deepseek-v2-lite", 8, *LONG, ckpt, "parallel.dp_shard=4", "parallel.cp=2")
    two = memory.activation_bytes(two_plan)
    four = memory.activation_bytes(
        _plan("deepseek-v2-lite", 8, *LONG, ckpt, "parallel.dp_shard=2", "parallel.cp=4")
    )
    whole = memory.activation_bytes(_plan("deepseek-v2-lite", 8, *LONG, ckpt, "parallel.dp_shard=8"))
    plain = memory.layer_activation_bytes(two_plan.model, 5, 2, 1, 1, False)
    ringed = memory.layer_activation_bytes(two_plan.model, 5, 2, 1, 1, False, ring=True)
    heads, qk, v, seq = 16, 192, 128, 16384
    # ring attention saves its bf16 q, k, v and output, as flash does (no padded values off the CPU)
    assert ringed == pytest.approx(plain)
    for name in ("head", "moe_dispatch"):
        assert getattr(two, name) == pytest.approx(getattr(whole, name) / 2), name
        assert getattr(four, name) == pytest.approx(getattr(whole, name) / 4), name
    assert two.layers == pytest.approx(four.layers * 2) and two.backward == pytest.approx(four.backward * 2)
    assert whole.cp_ring == 0 and whole.head > 0
    last = two_plan.model.num_hidden_layers - 1  # the first layer backward meets: its MLP freed first
    four_plan = _plan("deepseek-v2-lite", 8, *LONG, ckpt, "parallel.dp_shard=2", "parallel.cp=4")
    for cp, plan, acts in ((2, two_plan, two), (4, four_plan, four)):
        tokens = seq / cp
        ring = (2 * 2 * heads * (qk + v) + 3 * 4 * heads * (qk + v) + 4 * heads * qk) * tokens
        assert memory.ring_working_bytes(plan, 1) == pytest.approx(ring), cp
        freed = memory._mlp_saved(two_plan.model, last, 2, 1, 1) * tokens
        # V2-Lite's last MoE layer frees more than the ring takes: its buffers add nothing to the peak
        assert freed > ring and acts.cp_ring == 0, cp
    packed = _plan(
        "deepseek-v2-lite", 8, *LONG, ckpt, "parallel.dp_shard=4", "parallel.cp=2", "data.packing=true"
    )
    c = seq / 4
    assert memory.ring_working_bytes(packed, 1) == pytest.approx(
        memory.ring_working_bytes(two_plan, 1) + 2 * c * c
    )


def test_ring_value_width_follows_the_block_kernel():
    """MLA's values run zero-padded to 192 on the CPU's flash kernel, unpadded (128) on CUDA's
    memory-efficient one; a dense model's are the head size everywhere; the CPU chunks grow to match."""
    cfg = get_preset("deepseek-v2-lite")
    assert memory.ring_value_width(cfg, "cpu", torch.bfloat16, False) == 192
    assert memory.ring_value_width(cfg, "cuda", torch.bfloat16, False) == 128
    assert memory.ring_value_width(cfg, "cuda", torch.bfloat16, True) == 128
    dense = get_preset("deepseek-llm-7b")
    for device in ("cpu", "cuda"):
        assert memory.ring_value_width(dense, device, torch.bfloat16, False) == dense.head_dim
    cpu = RunPlan.resolve(
        load_config(
            None,
            [
                "train.micro_batch_size=1",
                *LONG,
                "parallel.dp_shard=4",
                "parallel.cp=2",
                "precision.dtype=bf16",
            ],
        ),
        cfg,
        8,
        "cpu",
    )
    cuda = _plan("deepseek-v2-lite", 8, *LONG, "parallel.dp_shard=4", "parallel.cp=2")
    pad = (2 * 2 * 16 * 64 + 3 * 4 * 16 * 64 + 2 * 2 * 16 * 192) * seq_tokens(cpu)
    assert memory.ring_working_bytes(cpu, 1) == pytest.approx(memory.ring_working_bytes(cuda, 1) + pad)


def seq_tokens(plan: RunPlan) -> float:
    return plan.job.train.seq_len / plan.cp


def test_dense_ring_chunks_are_the_repeated_keys_and_values_of_this_tp_ranks_heads():
    plan = _plan("deepseek-llm-7b", 8, *LONG, "parallel.tp=2", "parallel.dp_shard=2", "parallel.cp=2")
    cfg = plan.model
    h = cfg.num_attention_heads / 2
    assert memory.ring_chunk_bytes(cfg, 2, 2, cfg.head_dim) == 2 * h * 2 * cfg.head_dim


def test_state_shards_over_dp_shard_times_cp():
    """FSDP's group is ``dp_shard × cp``: every rank of dp_shard=4 × cp=2 holds what a rank of
    dp_shard=8 holds, experts included (EP draws its 8 ranks from dp_shard × cp)."""
    for ep in ("parallel.ep=1", "parallel.ep=8"):
        eight = _plan("deepseek-v2-lite", 8, *LONG, "parallel.dp_shard=8", ep)
        four_by_two = _plan("deepseek-v2-lite", 8, *LONG, "parallel.dp_shard=4", "parallel.cp=2", ep)
        assert [memory.state_bytes(four_by_two, r) for r in range(8)] == [
            memory.state_bytes(eight, r) for r in range(8)
        ], ep
        assert memory.comm_buffer_bytes(four_by_two) == memory.comm_buffer_bytes(eight)
    # the same gathers and reduce-scatters per micro-batch over a group of 8; cp=2 has half the
    # data-parallel ranks, so each runs twice the micro-batches
    hw = GPUS["h100-80g"]
    assert four_by_two.accum_steps == 2 * eight.accum_steps
    assert step_time(four_by_two, hw).fsdp_s == pytest.approx(2 * step_time(eight, hw).fsdp_s)


def test_cp_group_alone_is_an_fsdp_group():
    """One data-parallel rank with cp=2: the two cp ranks still share (and shard) one replica."""
    plan = _plan("deepseek-v2-lite", 2, *LONG, "parallel.dp_shard=1", "parallel.cp=2")
    whole = memory.state_bytes(_plan("deepseek-v2-lite", 1, *LONG), 0)
    assert plan.uses_fsdp
    assert memory.state_bytes(plan, 0).params + memory.state_bytes(plan, 1).params == whole.params


def _ring_by_hand(plan: RunPlan, bandwidth: float, peak: float) -> float:
    """ring_attention.py's hops (MLA on CUDA: values unpadded): forward, cp-1 bf16 [k | v] chunks, each
    beside one step's two blocks (QKᵀ and PV of c × c); backward, cp-1 chunks and cp fp32 dK/dV, each
    beside the next step's blocks (2.5 × a forward step's), the last dK/dV waited for whole."""
    cfg = plan.model
    seq, cp = plan.job.train.seq_len, plan.cp
    heads, c = cfg.num_attention_heads / plan.tp, seq / (2 * cp)
    kv = 2 * heads * (192 + 128) * seq / cp / bandwidth
    grad = 2 * kv
    f = 2 * 2 * c * c * heads * (192 + 128) / peak
    b = 2.5 * f
    per_layer = (cp - 1) * max(0.0, kv - f)
    per_layer += max(0.0, kv - b) + (cp - 2) * max(0.0, kv + grad - b) + max(0.0, grad - b) + grad
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return per_layer * layers / plan.pp * plan.accum_steps


def test_ring_time_is_what_attention_does_not_hide():
    """V3 at 128K inside a node: every hop hides behind its step's blocks but the last dK/dV hop home;
    across nodes (cp × tp = 64 ranks) at 16K the forward and backward hops show too."""
    hw = GPUS["h800"]
    peak = hw.bf16_tflops * 1e12 * 0.45
    base = ("train.seq_len=131072", "train.global_batch_size=64")
    inside = _plan("deepseek-v3", 64, *base, "parallel.dp_shard=8", "parallel.cp=8")
    cfg = inside.model
    home_only = 4 * 128 * 320 * 16384 / hw.intra_bytes_per_s * 62 * inside.accum_steps
    assert step_time(inside, hw).cp_s == pytest.approx(home_only)
    assert _ring_by_hand(inside, hw.intra_bytes_per_s, peak) == pytest.approx(home_only)
    short = ("train.seq_len=16384", "train.global_batch_size=64")
    across = _plan("deepseek-v3", 512, *short, "parallel.tp=8", "parallel.dp_shard=16", "parallel.cp=4")
    shows = _ring_by_hand(across, hw.inter_bytes_per_s, peak)
    assert step_time(across, hw).cp_s == pytest.approx(shows)
    heads, c = 16, 16384 / 8
    kv = 2 * heads * 320 * 16384 / 4 / hw.inter_bytes_per_s
    assert kv > 2 * 2 * c * c * heads * 320 / peak  # the forward hop shows
    assert cfg.num_nextn_predict_layers == 1


def test_ring_attention_flops():
    """On CUDA the ring computes MLA's attention FLOPs and no more (causal blocks, values unpadded);
    packed documents compute the diagonal blocks whole: cp=2 adds 1/4 of the attention FLOPs."""
    from seektrain.observe.flops import attention_flops_per_token

    hw = GPUS["h100-80g"]
    one = _plan("deepseek-v2-lite", 8, *LONG, "parallel.dp_shard=8")
    two = _plan("deepseek-v2-lite", 8, *LONG, "parallel.dp_shard=4", "parallel.cp=2")
    assert step_time(two, hw).compute_s == pytest.approx(step_time(one, hw).compute_s)
    packed = ("data.packing=true",)
    one_p = _plan("deepseek-v2-lite", 8, *LONG, *packed, "parallel.dp_shard=8")
    two_p = _plan("deepseek-v2-lite", 8, *LONG, *packed, "parallel.dp_shard=4", "parallel.cp=2")
    attention = attention_flops_per_token(one.model, 16384) * one.tokens_per_step
    extra = attention * (5 / 4 - 1) / (hw.bf16_tflops * 1e12 * 0.45) / 8
    assert step_time(two_p, hw).compute_s == pytest.approx(step_time(one_p, hw).compute_s + extra)


def test_search_tries_cp_for_long_sequences_only():
    assert cp_degrees(2048, 4096) == [1]  # short sequences: plans as before
    assert cp_degrees(2048, 12288) == [1, 2]  # 2·cp divides 12288 and each rank keeps >= 4096 tokens
    assert cp_degrees(2048, 131072) == [1, 2, 4, 8, 16, 32]
    assert cp_degrees(48, 131072) == [1, 2, 4, 8, 16]  # powers of two dividing the world


# (model, world, gpu, overrides, memory total bytes, step seconds) of plans without cp, as the planner
# gave them before it knew cp (main at 855f759)
BEFORE_CP = [
    (
        "deepseek-v3",
        2048,
        "h800",
        [
            "train.seq_len=4096",
            "train.global_batch_size=8192",
            "parallel.tp=4",
            "parallel.pp=16",
            "parallel.dp_shard=32",
        ],
        70519400495.2,
        12.609932448729568,
    ),
    (
        "deepseek-v3",
        2048,
        "h800",
        [
            "train.seq_len=131072",
            "train.global_batch_size=2048",
            "parallel.tp=8",
            "parallel.pp=8",
            "parallel.dp_shard=32",
            "train.activation_checkpoint=full",
            "parallel.cpu_offload=true",
        ],
        83019112038.4,
        576.383368268309,
    ),
    (
        "deepseek-v2-lite",
        16,
        "h100-80g",
        [
            "train.seq_len=4096",
            "train.global_batch_size=64",
            "parallel.dp_shard=8",
            "parallel.dp_replicate=2",
            "parallel.ep=8",
            "train.activation_checkpoint=selective",
        ],
        55863052687.0,
        1.2157826156088887,
    ),
    (
        "deepseek-llm-67b",
        64,
        "a100-80g",
        [
            "train.seq_len=4096",
            "train.global_batch_size=256",
            "parallel.tp=4",
            "parallel.pp=2",
            "parallel.dp_shard=8",
        ],
        74752640794.6,
        52.66017071419077,
    ),
]


@pytest.mark.parametrize("model, world, gpu, overrides, total, step", BEFORE_CP)
def test_plans_without_cp_are_unchanged(model, world, gpu, overrides, total, step):
    from seektrain.plan.search import memory_breakdown

    plan = _plan(model, world, *overrides)
    assert memory_breakdown(plan, GPUS[gpu]).total == pytest.approx(total, rel=1e-12)
    assert step_time(plan, GPUS[gpu]).total_s == pytest.approx(step, rel=1e-12)


def test_v3_at_128k_picks_cp_with_headroom():
    """Issue 21's point: without cp the best of 2048 H800s at 128K is tp=8 pp=8 with full recompute and
    CPU offload, 77.3 of 79.1 GiB (70.7 of it logits and loss), 576 s a step. With the ring in the
    compute dtype and its backward overlapped, the search's pick (``seektrain plan``, docs/planning.md)
    is tp=2 pp=2 dp_shard=128 cp=4: attention's FLOPs as without cp, the ring's hops hidden inside the
    node but the last dK/dV hop home, no bubble worth 11% and less TP traffic, so it is faster; and it
    leaves headroom (a cp rank's quarter of the logits)."""
    from seektrain.plan.search import evaluate

    hw = GPUS["h800"]
    job = load_config(
        None, ["train.seq_len=131072", "train.global_batch_size=2048", "train.micro_batch_size=1"]
    )
    model = get_preset("deepseek-v3")
    common = {
        "train.micro_batch_size": 1,
        "train.activation_checkpoint": "full",
        "parallel.cpu_offload": True,
    }
    no_cp = evaluate(
        job, model, 2048, hw, {**common, "parallel.tp": 8, "parallel.pp": 8, "parallel.dp_shard": 32}
    )
    with_cp = evaluate(
        job,
        model,
        2048,
        hw,
        {**common, "parallel.tp": 2, "parallel.pp": 2, "parallel.dp_shard": 128, "parallel.cp": 4},
    )
    assert no_cp.feasible and with_cp.feasible
    assert no_cp.memory.total / GIB == pytest.approx(77.3, abs=0.05)
    assert no_cp.memory.activations.head / GIB == pytest.approx(70.7, abs=0.05)
    assert with_cp.memory.total / GIB == pytest.approx(72.3, abs=0.05)
    assert with_cp.memory.total < 0.92 * hw.memory_gib * GIB
    assert with_cp.time.compute_s == pytest.approx(no_cp.time.compute_s)  # no extra attention FLOPs
    assert 0 < with_cp.time.cp_s < 0.02 * with_cp.time.total_s
    assert with_cp.time.total_s == pytest.approx(527.0, abs=0.1)
    assert with_cp.time.total_s < 0.92 * no_cp.time.total_s
