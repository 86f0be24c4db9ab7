"""Predicted step time of a run plan on given hardware: a roofline of the step's FLOPs at a stated
efficiency, plus the communication that is not hidden behind compute, times the pipeline bubble.

Assumptions (each a number here, so they can be argued with):

- Matmuls reach ``MATMUL_EFFICIENCY`` of the dense bf16 peak (fp32 compute: a quarter of it on GPUs,
  whose fp32 is not tensor-core). Fully checkpointed layers are computed forward twice (+1/3 of their FLOPs).
  Selectively checkpointed layers recompute no matmul (about 0 extra FLOPs) but redo the elementwise ops,
  norms and routing arithmetic, which are memory-bound: they cost the bytes those ops move at the device's
  memory bandwidth, ``RECOMPUTE_TRAFFIC`` times the bytes they write (``memory.selective_rebuilt_bytes``).
- ``precision.fp8``: the FLOPs of the linears it converts (``plan/fp8_flops.py``, ``fp8_matmul_params``)
  run at the same efficiency of the fp8 peak, the rest at the bf16 peak; the FP8 casts (memory-bound) are
  not counted. Hardware without fp8 tensor cores (``fp8_tflops == 0``) keeps the bf16 peak.
- Ring collectives move ``(n-1)/n`` of the data per rank at the link's one-direction bandwidth: NVLink when
  the group fits in a node, else the network (per GPU).
- FSDP's all-gathers and reduce-scatters overlap with compute (only what exceeds compute shows).
  Tensor-parallel all-gathers/reduce-scatters and expert all-to-alls sit on the critical path.
- ``parallel.cpu_offload``: state crosses PCIe (``PCIE_BYTES_PER_S``) and AdamW streams it through host
  memory (``HOST_BYTES_PER_S``), not overlapped.
- ``lora.enabled``: the frozen base computes no weight gradients, so its matmuls cost 4 (not 6) FLOPs per
  parameter and token; the adapters' own matmuls (6 × r × (in + out) per adapted weight and token) are
  added. FSDP gathers the base and the adapters, but reduce-scatters only the adapters' gradients; CPU
  offload moves the base up, only the adapters' gradients down, and runs AdamW over the adapters only.
- Pipeline: the bubble is ``(pp-1)/micro-batches`` (1F1B, GPipe), divided by the stages per rank
  (interleaved), halved for zero-bubble V; activations sent between stages are added.
- Context parallelism, as ``parallel/ring_attention.py`` runs it: blocks run through a fused attention
  kernel in the compute dtype (at the same efficiency as the matmuls; on CUDA the kernel plain attention
  gets, ``platform/ring_blocks.py``). The extra FLOPs: MLA's values zero-padded to the query/key width
  where the kernel wants one head size (the CPU's, ``memory.ring_value_width``),
  and with packed documents the diagonal blocks computed whole under their bias
  (``(2·cp+1)/(2·cp)`` of the causal FLOPs). Per layer, forward takes ``cp-1`` hops of this rank's
  key/value chunk (compute dtype), each issued before a step's blocks, so it shows only
  ``max(0, comm - compute)``; backward issues ``cp-1`` chunk hops the same way and sends each step's
  fp32 dK/dV after its blocks, waited for at the end of the next step (it overlaps the next step's
  blocks, beside that step's chunk hop); the last dK/dV hop home shows whole. A backward step computes
  ``RING_BACKWARD_PER_FORWARD`` times a forward step. The FSDP group grows to ``dp_shard × cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from seektrain.observe.flops import active_matmul_params, model_flops_per_token
from seektrain.plan import lora_memory
from seektrain.plan.fp8_flops import fp8_matmul_params
from seektrain.plan.hardware import Hardware
from seektrain.plan.recompute import SELECTIVE, checkpoint_every

MATMUL_EFFICIENCY = 0.45  # of the dense peak; a typical well-tuned large-model figure (see docs/planning.md)
CPU_EFFICIENCY = 0.35  # of the measured matmul probe
PCIE_BYTES_PER_S = 25e9  # parallel.cpu_offload: PCIe Gen4/5 x16 achieved, one direction (assumption)
HOST_BYTES_PER_S = 20e9  # host memory bandwidth one rank's CPU optimizer step gets (assumption)
# Bytes read and written per byte a recomputed op writes: an elementwise op with two inputs of its output's
# size (the products, sums and casts of norms, RoPE, SwiGLU, routing) reads two and writes one.
RECOMPUTE_TRAFFIC = 3


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    fsdp_s: float  # FSDP/HSDP/DDP traffic per step (overlapped: only the excess counts)
    tp_s: float
    ep_s: float
    pp_s: float  # stage-to-stage activations
    bubble: float  # fraction added by the pipeline bubble
    total_s: float
    model_flops: float  # per step, all ranks (what MFU counts)
    offload_s: float = 0.0  # parallel.cpu_offload: host transfers and the host optimizer step
    recompute_s: float = 0.0  # selective checkpointing's memory-bound recomputation (inside compute_s)
    cp_s: float = 0.0  # context parallelism: the ring's transfers not hidden behind attention


def _ring(bytes_: float, n: int, bandwidth: float) -> float:
    return 0.0 if n <= 1 else bytes_ * (n - 1) / n / bandwidth


def _link(hw: Hardware, group_span: int) -> float:
    """Bandwidth of a group whose ranks are ``group_span`` consecutive ranks apart at most."""
    return hw.intra_bytes_per_s if group_span <= hw.gpus_per_node else hw.inter_bytes_per_s


def step_time(plan, hw: Hardware, state=None) -> StepTime:
    """``state``: the plan's ``memory.max_state_bytes`` when the caller has it already."""
    cfg, job = plan.model, plan.job
    seq, tokens = job.train.seq_len, plan.tokens_per_step
    a = plan.compute_dtype.itemsize
    flops = model_flops_per_token(cfg, seq, include_mtp=plan.use_mtp) * tokens
    lora = plan.lora
    if lora:  # no weight gradients for the base; the adapters' forward and backward
        adapter_flops = sum(
            6.0
            * lora.rank
            * (ad.in_features + ad.out_features)
            * (cfg.num_experts_per_tok if ad.expert else 1)
            for ad in lora_memory.adapters(cfg, lora)
            if plan.use_mtp or ad.block is None or ad.block < cfg.num_hidden_layers
        )
        flops += (adapter_flops - 2.0 * active_matmul_params(cfg, plan.use_mtp)) * tokens
    every = checkpoint_every(job.train.activation_checkpoint)
    selective = job.train.activation_checkpoint == SELECTIVE
    recompute = (1 / 3) * (1 / every) if every and not selective else 0.0
    efficiency = CPU_EFFICIENCY if hw.name == "cpu" else MATMUL_EFFICIENCY
    peak = hw.bf16_tflops * 1e12 * efficiency
    if a == 4 and hw.name != "cpu":
        peak /= 4
    compute_time = flops / peak
    if job.precision.fp8 != "none" and hw.fp8_tflops > 0:
        fp8_flops = 6.0 * fp8_matmul_params(cfg, job.precision.fp8, include_mtp=plan.use_mtp) * tokens
        compute_time = (flops - fp8_flops) / peak + fp8_flops / (hw.fp8_tflops * 1e12 * efficiency)
    compute_time += ring_extra_flops(plan) / peak
    recompute_s = selective_recompute_s(plan, hw) if selective else 0.0
    compute = compute_time * (1 + recompute) / plan.world_size + recompute_s

    # parameters of one pipeline rank's share, per tensor-parallel rank (what FSDP moves)
    from seektrain.plan.memory import fsdp_ranks, max_state_bytes

    state = state or max_state_bytes(plan)
    shards = fsdp_ranks(plan)  # dp_shard × cp
    shard = shards if plan.uses_fsdp else 1
    local_params = state.params / 4 * shard  # trained parameters (under LoRA the adapters)
    gathered = local_params + state.frozen / a * shard  # what FSDP gathers (a frozen base too)
    micro = plan.accum_steps if plan.pp == 1 else 1
    fsdp = 0.0
    if plan.uses_fsdp and shards > 1:
        gathers = 2 if plan.reshard_after_forward else 1
        reduce_bytes = 2 if job.precision.reduce_dtype == "bf16" else 4
        per_micro = gathered * gathers * a + local_params * reduce_bytes
        fsdp = micro * _ring(per_micro, shards, _link(hw, plan.tp * shards))
    if plan.dp_replicate > 1:  # HSDP/DDP: gradients all-reduced across replicas (twice a ring's bytes)
        fsdp += 2 * _ring(local_params / shard * 4, plan.dp_replicate, _link(hw, plan.world_size // plan.pp))
    exposed_fsdp = max(0.0, fsdp - compute)

    local_tokens = tokens / plan.dp / plan.cp  # per rank per step (all micro-batches)
    d = cfg.hidden_size
    n_layers = cfg.num_hidden_layers / plan.pp
    tp = 0.0
    if plan.tp > 1:  # per layer: attention and MLP each all-gather and reduce-scatter, forward and backward
        tp = _ring(8 * n_layers * local_tokens * d * a, plan.tp, _link(hw, plan.tp))
    ep = 0.0
    if plan.ep > 1:  # dispatch + combine, forward and backward, per MoE layer
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) / plan.pp
        slots = local_tokens * cfg.num_experts_per_tok / plan.tp
        ep = _ring(4 * moe_layers * slots * d * a, plan.ep, _link(hw, plan.ep))  # ep ranks are neighbours
    pp = bubble = 0.0
    if plan.pp > 1:
        pp = 2 * local_tokens * d * a / hw.inter_bytes_per_s
        schedule = job.parallel.pp_schedule
        bubble = (plan.pp - 1) / plan.pp_microbatches
        if schedule == "interleaved-1f1b":
            bubble /= plan.pp_stages_per_rank
        elif schedule == "zbv":
            bubble /= 2
    cp = ring_exposed_s(plan, hw, peak, 3 * recompute)  # 3 × recompute: the recomputed layers' share
    offload = 0.0
    if plan.cpu_offload and plan.uses_fsdp:
        # parameters up and gradients down over PCIe each step, AdamW on the host reading and writing
        # parameters, gradients and both moments
        offload = (state.params + state.frozen + state.grads) / PCIE_BYTES_PER_S + 2 * (
            state.params * 4
        ) / HOST_BYTES_PER_S
    total = (compute + exposed_fsdp + tp + ep + pp + cp) * (1 + bubble) + offload
    return StepTime(compute, fsdp, tp, ep, pp, bubble, total, flops, offload, recompute_s, cp)


# attention backward's matmuls per forward matmul: it recomputes QKᵀ and computes dP, dV, dQ and dK (5 of
# the forward's 2), the FlashAttention count
RING_BACKWARD_PER_FORWARD = 2.5


def _ring_widths(plan) -> tuple[int, int, int]:
    """(query/key head size, value head size, the value width the ring's block kernel runs with)."""
    from seektrain.plan.memory import ring_packed, ring_value_width

    cfg = plan.model
    qk = cfg.qk_head_dim
    v = cfg.value_head_dim
    return qk, v, ring_value_width(cfg, plan.device_type, plan.compute_dtype, ring_packed(plan))


def ring_extra_flops(plan) -> float:
    """FLOPs per step, all ranks, that context parallelism's ring adds at the compute-dtype rate: the
    values' zero padding (``(qk + width) / (qk + v)`` of the attention FLOPs) and, with packed
    documents, whole diagonal blocks (``(2·cp+1)/(2·cp)`` of the causal count). 0 without cp."""
    if plan.cp <= 1:
        return 0.0
    from seektrain.observe.flops import attention_flops_per_token
    from seektrain.plan.memory import ring_packed

    attention = (
        attention_flops_per_token(plan.model, plan.job.train.seq_len, plan.use_mtp) * plan.tokens_per_step
    )
    qk, v, width = _ring_widths(plan)
    done = (2 * plan.cp + 1) / (2 * plan.cp) if ring_packed(plan) else 1.0
    return attention * (done * (qk + width) / (qk + v) - 1)


def ring_exposed_s(plan, hw: Hardware, peak: float, recomputed: float = 0.0) -> float:
    """Seconds per step one rank waits on the context-parallel ring (see the module docstring). Per
    layer and sequence, with ``kv`` a chunk hop's seconds, ``grad`` a dK/dV hop's, ``f`` and ``b`` a
    step's forward and backward block seconds (2 blocks of ``c × c`` per step, c = seq_len / (2·cp)):
    forward ``(cp-1)·max(0, kv-f)``; backward ``max(0, kv-b)`` (step 0: the chunk hop alone),
    ``(cp-2)·max(0, kv+grad-b)``, ``max(0, grad-b)`` (the last step: the previous dK/dV alone) and
    ``grad`` (home). ``recomputed``: the share of layers whose forward (ring included) full
    checkpointing runs twice. Both sides grow with the sequences of a micro-batch alike, so the sum is
    per sequence. The cp ranks are ``tp`` ranks apart: NVLink while ``cp × tp`` fits in a node, else
    the network."""
    if plan.cp <= 1:
        return 0.0
    from seektrain.plan.memory import FP32, ring_chunk_bytes

    cfg, job = plan.model, plan.job
    seq, cp = job.train.seq_len, plan.cp
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if plan.use_mtp else 0)
    qk, _, width = _ring_widths(plan)
    tokens = seq / cp  # this rank's share of one sequence
    link = _link(hw, cp * plan.tp)
    kv = ring_chunk_bytes(cfg, plan.tp, plan.compute_dtype.itemsize, width) * tokens / link
    grad = ring_chunk_bytes(cfg, plan.tp, FP32, width) * tokens / link
    c = seq / (2 * cp)
    # a step's two blocks: QKᵀ and PV, 2 FLOPs per multiply-add, of this rank's heads
    f = 2 * 2 * c * c * cfg.num_attention_heads / plan.tp * (qk + width) / peak
    b = RING_BACKWARD_PER_FORWARD * f
    per_layer = (1 + recomputed) * (cp - 1) * max(0.0, kv - f)
    per_layer += max(0.0, kv - b) + (cp - 2) * max(0.0, kv + grad - b) + max(0.0, grad - b) + grad
    sequences = job.train.micro_batch_size * plan.accum_steps  # this rank's per step
    return per_layer * layers / plan.pp * sequences


def selective_recompute_s(plan, hw: Hardware) -> float:
    """Seconds per step one rank spends recomputing its selectively checkpointed layers: the bytes the
    recomputation writes (every layer of the model per token, divided over the pipeline stages; per
    tensor-parallel rank as the memory model counts them) times ``RECOMPUTE_TRAFFIC``, for the tokens of
    one rank (a data-parallel rank's, split over its cp ranks), at the device's memory bandwidth."""
    from seektrain.plan.memory import selective_rebuilt_bytes

    cfg = plan.model
    a = plan.compute_dtype.itemsize
    per_token = (
        sum(
            selective_rebuilt_bytes(cfg, i, a, plan.tp, plan.ep, hw.name == "cpu", plan.cp > 1)
            for i in range(cfg.num_hidden_layers)
        )
        / plan.pp
    )
    local_tokens = plan.tokens_per_step / plan.dp / plan.cp
    return RECOMPUTE_TRAFFIC * per_token * local_tokens / (hw.memory_gbs * 1e9)
