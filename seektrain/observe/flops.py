"""Training FLOPs per token counted from the model config, hardware peaks, and MFU.

MFU (model FLOPs utilisation, PaLM appendix B) is ``tokens/s x model FLOPs per token / peak FLOP/s``.
"Model" FLOPs are what the architecture needs, not what the kernels happen to do: activation
recomputation, padding and the recomputed attention scores of flash-attention backward are not counted.
So MFU stays comparable across parallel layouts and checkpointing choices.

Formula (per token, training = forward + backward, backward = 2 x forward):

    matmul:    6 x N_active       N_active = weights a token multiplies with: attention projections,
                                  the dense MLP or (router + top-k routed experts + shared experts),
                                  the LM head, and the MTP modules (eh_proj, block, head) if present.
                                  The embedding lookup is a gather, not a matmul: not counted.
    attention: 3 x L_att x H x (qk_head_dim + value_head_dim) x T   (L_att counts MTP blocks too)
               forward, per query token and head: QK^T is 2 T qk_dim, PV is 2 T v_dim;
               a causal mask leaves T/2 keys on average (halves it); training = 3 x forward.
               Written out: 6 x 2 x L_att x H x (qk + v)/2 x T/2.

The count is analytic (nothing is built: the weights come from the shape description, models/deepseek/shapes.py),
so it is free for a 671B config.
"""

from __future__ import annotations

import functools
import time

import torch

from seektrain.models import block_weights, layer_weights
from seektrain.models.config import ModelConfig
from seektrain.models.registry import family_for


# ----------------------------------------------------------------------------- FLOPs per token
def layer_matmul_params(cfg: ModelConfig, layer_idx: int) -> int:
    """Matmul weights one token uses in decoder layer ``layer_idx`` (an index past the decoder layers is
    MTP block ``layer_idx - L``; pipeline balancing uses this): its attention projections, its dense MLP or
    router, top-k routed experts and shared experts, from the model's shape description."""
    if layer_idx < cfg.num_hidden_layers:
        return sum(w.matmul_params for w in layer_weights(cfg, layer_idx))
    return sum(w.matmul_params for w in block_weights(cfg, layer_idx, ""))


def active_matmul_params(cfg: ModelConfig, include_mtp: bool = True) -> int:
    """Weights one token multiplies with (biases and norms are not matmuls; the embedding is a lookup):
    every weight of the shape description, and the shared head once more per MTP depth."""
    n_mtp = cfg.num_nextn_predict_layers if include_mtp else 0
    weights = family_for(cfg).weights(cfg)
    total = sum(w.matmul_params for w in weights.values() if include_mtp or not w.path.startswith("mtp."))
    return total + n_mtp * weights["lm_head"].matmul_params


def attention_flops_per_token(
    cfg: ModelConfig, seq_len: int, include_mtp: bool = True, causal: bool = True
) -> float:
    """Score (QK^T) and value (PV) FLOPs of forward + backward per token; ``causal`` halves them."""
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0)
    # forward 2 T (qk + v) per head and layer, x3 for training: 6 x 2 x L x H x (qk + v)/2 x T
    full = 6 * 2 * layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.value_head_dim) / 2 * seq_len
    return full / 2 if causal else full


def model_flops_per_token(
    cfg: ModelConfig, seq_len: int, include_mtp: bool = True, causal: bool = True
) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length ``seq_len``."""
    return 6.0 * active_matmul_params(cfg, include_mtp) + attention_flops_per_token(
        cfg, seq_len, include_mtp, causal
    )


# ----------------------------------------------------------------------------- hardware peaks
# Dense (no 2:4 sparsity) tensor-core peaks in TFLOP/s from NVIDIA datasheets:
# (half = bf16/fp16 with fp32 accumulate, tf32, plain fp32). Order matters: the first match wins.
_GPU_PEAKS: list[tuple[tuple[str, ...], str, float, float, float]] = [
    (("H100", "NVL"), "H100 NVL", 835.0, 417.5, 60.0),
    (("H100", "PCIE"), "H100 PCIe", 756.0, 378.0, 51.0),
    (("H100",), "H100 SXM", 989.4, 494.7, 66.9),
    (("H200", "NVL"), "H200 NVL", 835.0, 417.5, 60.0),
    (("H200",), "H200 SXM", 989.4, 494.7, 66.9),
    (("H800", "PCIE"), "H800 PCIe", 756.0, 378.0, 51.0),
    (("H800",), "H800 SXM", 989.4, 494.7, 66.9),
    (("A100",), "A100", 312.0, 156.0, 19.5),
    (("A800",), "A800", 312.0, 156.0, 19.5),
    (("L40S",), "L40S", 362.05, 183.0, 91.6),
    (("4090",), "GeForce RTX 4090", 165.2, 82.6, 82.6),
    (("V100", "PCIE"), "V100 PCIe", 112.0, 14.0, 14.0),  # no bf16/tf32 tensor cores on Volta
    (("V100",), "V100 SXM2", 125.0, 15.7, 15.7),
]


def gpu_peak_from_name(name: str, dtype: torch.dtype, tf32: bool) -> tuple[float, str] | None:
    """Datasheet peak FLOP/s for a ``torch.cuda.get_device_name`` string, or None if unknown."""
    upper = name.upper()
    for needles, label, half, tf32_peak, fp32 in _GPU_PEAKS:
        if all(n in upper for n in needles):
            if dtype in (torch.bfloat16, torch.float16):
                if dtype == torch.bfloat16 and label.startswith("V100"):
                    return fp32 * 1e12, f"datasheet {label} fp32 (Volta has no bf16 tensor cores)"
                return half * 1e12, f"datasheet {label} {str(dtype).removeprefix('torch.')} dense"
            if tf32:
                return tf32_peak * 1e12, f"datasheet {label} tf32 dense"
            return fp32 * 1e12, f"datasheet {label} fp32"
    return None


SQUARE = (2048, 2048, 2048)  # (m, k, n) of the probe every device gets; a model adds its own shapes


def _time_one(a: torch.Tensor, b: torch.Tensor, sync) -> float:
    t0 = time.perf_counter()
    a @ b
    sync()
    return time.perf_counter() - t0


def _shape_rate(
    dev: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], seconds: float, sync
) -> float:
    """Best FLOP/s of ``[m, k] @ [k, n]`` over three windows of ``seconds / 3``. A shape starts at 1/8 of
    each side and grows (x8 the work per step) while one matmul of the next size fits a quarter of the
    budget: a dtype without native kernels (bf16 on AVX2: 0.1-0.4 GFLOP/s, so ~100 s for one 2048^3)
    is measured on a smaller matmul instead of stalling the start-up."""
    m, k, n = shape
    dims, took = None, 0.0
    for div in (8, 4, 2, 1):
        size = (max(1, m // div), max(1, k // div), max(1, n // div))
        if dims is not None and took * 8 > seconds / 4:
            break
        a = torch.randn(size[0], size[1], device=dev).to(dtype)
        b = torch.randn(size[1], size[2], device=dev).to(dtype)
        _time_one(a, b, sync)  # warm-up: kernel choice, first touch of the pages
        took, dims = _time_one(a, b, sync), size
    best = 0.0
    for _ in range(3):
        iters, start = 0, time.perf_counter()
        while True:
            a @ b
            iters += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / 3 or iters >= 10_000:
                break
        best = max(best, 2.0 * dims[0] * dims[1] * dims[2] * iters / elapsed)
    return best


@functools.cache
def _probe(
    device: str,
    dtype: torch.dtype,
    threads: int,
    seconds: float,
    shapes: tuple[tuple[int, int, int], ...] = (SQUARE,),
) -> float:
    """Measured matmul FLOP/s: the best over ``shapes`` (each ``(m, k, n)``), ``seconds`` for them all.
    Cached per process because the number is a property of the machine, and a probe per call would add
    up (every test run starts a trainer)."""
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return max(_shape_rate(dev, dtype, shape, seconds / len(shapes), sync) for shape in shapes)


def peak_flops(
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    probe_seconds: float = 0.5,
    shapes: tuple[tuple[int, int, int], ...] = (),
) -> tuple[float, str]:
    """(peak FLOP/s, where the number came from). Known NVIDIA GPUs use datasheet numbers; a CPU or an
    unknown GPU is measured in ``dtype`` at the current torch thread count, with a 2048^3 matmul and the
    matmul ``shapes`` ``(m, k, n)`` a model really runs (``model_matmul_shapes``): the best of them is
    the peak. A probe can still fall below what a run achieves (other processes slowed it, or the
    model's kernels beat a plain matmul), which is why ``MfuMeter`` bounds MFU by the achieved rate."""
    dev = torch.device(device)
    probed = (SQUARE, *sorted(set(shapes) - {SQUARE}))
    what = f"{str(dtype).removeprefix('torch.')}, best of {len(probed)} matmul shape{'s' * (len(probed) > 1)}"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        found = gpu_peak_from_name(name, dtype, torch.backends.cuda.matmul.allow_tf32)
        if found is not None:
            return found
        flops = _probe(str(dev), dtype, 0, probe_seconds, probed)
        return flops, f"measured matmul probe on {name} ({what})"
    threads = torch.get_num_threads()
    flops = _probe(dev.type, dtype, threads, probe_seconds, probed)
    return flops, f"measured matmul probe on {dev.type}, {threads} threads ({what})"


def model_matmul_shapes(cfg: ModelConfig, tokens: int) -> tuple[tuple[int, int, int], ...]:
    """The ``(m, k, n)`` of the forward matmuls with the most FLOPs per call for ``tokens`` rows (one
    micro-batch): a projection from the hidden size, the MLP (or one expert with its share of the tokens),
    and the LM head. The probe needs representative shapes, not every one."""
    d = cfg.hidden_size
    shapes = {(tokens, d, d), (tokens, d, cfg.vocab_size)}
    expert = family_for(cfg).costs.expert_matmul_shape(cfg, tokens)
    if expert is not None:
        shapes.add(expert)
    if cfg.intermediate_size:
        shapes.add((tokens, d, cfg.intermediate_size))
    return tuple(sorted(shapes))


class MfuMeter:
    """MFU of each step against a peak that can never be below what a step achieved, so MFU <= 100%.

    The rule: ``peak`` starts as ``peak_flops`` in the run's compute dtype. When a step's model FLOP/s
    (``tokens/s x flops_per_token``, per device) exceed it, the probe was wrong (measured while other
    processes held the cores, or at shapes the model's kernels beat), and the achieved rate is the best
    lower bound of the true peak there is: ``peak`` is raised to it, that step reports 100%, and later
    steps are measured against the raised peak; ``source`` says so. A datasheet peak is a real ceiling
    and is never exceeded, so in practice only measured peaks move.
    """

    def __init__(self, peak: float, source: str, flops_per_token: float):
        self.peak, self.source, self.flops_per_token = peak, source, flops_per_token

    def __call__(self, step: int, tokens_per_s_per_device: float) -> float:
        achieved = tokens_per_s_per_device * self.flops_per_token
        if achieved > self.peak:
            self.peak = achieved
            self.source = (
                self.source.split("; raised", 1)[0] + f"; raised to the {achieved / 1e9:.3g} GFLOP/s "
                f"step {step} achieved (the probe was lower)"
            )
        return mfu(tokens_per_s_per_device, self.flops_per_token, self.peak)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Fraction (0..1) of ``peak`` FLOP/s achieved. Pass tokens/s and peak for the same set of devices
    (per device, or all ranks' tokens/s with peak x world size)."""
    if peak <= 0:
        return 0.0
    return tokens_per_s * flops_per_token / peak
