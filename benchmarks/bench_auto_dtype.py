"""Is ``precision.dtype=auto`` the faster dtype on this CPU? fp32 and bf16 training steps side by side.

One process, one model (``build_model`` with the CPU policy's kernels for each dtype, as training builds
it; the same weights) twice: fp32, and bf16 as FSDP's mixed-precision policy computes it (weights cast to
bf16, the fused
head + cross-entropy, backward; the V3 balancing bias stays fp32). Steps of the two alternate (the
order flips every iteration), so load from other processes hits both alike; every iteration draws a new
batch, the same one for both. The median tokens/s of each is reported with the dtype ``auto`` picks
here (``seektrain.platform.compute_dtype``) and the ratio of its speed to the faster one's; the issue's
bar is within 10%.

The default is ``make train``'s work on one of its two ranks: tiny-v3, 8 x 256 tokens, one thread.
To emulate an AVX2-only CPU on a bigger one, set the variables before Python starts (torch reads
``ATEN_CPU_CAPABILITY`` at import):

    python benchmarks/bench_auto_dtype.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_auto_dtype.py --iters 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_vs_hf import cast_model, load_avg, make_step
from seektrain.models import build_model, get_preset
from seektrain.platform import policy_for
from seektrain.platform.compute_dtype import choose_dtype, this_cpu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-v3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="1: what each of make train's two ranks gets")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=8, help="timed steps per dtype (interleaved)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    facts = this_cpu()
    auto = choose_dtype("auto", "cpu")
    bf16_flags = sorted(facts.flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    print(
        f"CPU: {cpu_name()} ({facts.vendor}), {os.cpu_count()} cores; flags {' '.join(bf16_flags)}; "
        f"torch kernels {facts.aten_capability}; ONEDNN_MAX_CPU_ISA={facts.onednn_max_isa or '(unset)'}"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load avg at start {load_avg()}")
    print(f"{auto.why}")
    print(
        f"model {args.preset} (MTP off), {args.batch} x {args.seq} tokens per step, fp32 and bf16 steps "
        "alternating, a new batch every step"
    )

    cfg = get_preset(args.preset).replace(num_nextn_predict_layers=0)
    policy = policy_for(torch.device("cpu"))
    steps = {
        name: make_step(
            cast_model(build_model(cfg, seed=0, kernels=policy.model_kernels(dtype)), dtype).train(), "fused"
        )
        for name, dtype in DTYPES.items()
    }
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + args.iters):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    for i in range(args.warmup):
        for step in steps.values():
            step(*batches[i])

    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(args.iters):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            steps[name](*batches[args.warmup + i])
            times[name].append(time.perf_counter() - t0)
        print(
            f"  step {i + 1}: "
            + "  ".join(f"{n} {args.batch * args.seq / times[n][-1]:7.0f} tok/s" for n in names),
            flush=True,
        )
    print(f"load avg at end {load_avg()}")

    rate = {n: args.batch * args.seq / statistics.median(ts) for n, ts in times.items()}
    faster = max(rate, key=rate.get)
    ratio = rate[auto.name] / rate[faster]
    print()
    print(
        "median tokens/s: "
        + "  ".join(f"{n} {rate[n]:.0f}" for n in names)
        + f"  (bf16/fp32 {rate['bf16'] / rate['fp32']:.2f}x)"
    )
    print(
        f"auto = {auto.name}: {ratio:.2f}x the faster dtype ({faster}); "
        + ("within 10%" if ratio >= 0.9 else "NOT within 10%")
    )
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
