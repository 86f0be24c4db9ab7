"""Forward+backward throughput of our ``Transformer`` against transformers' ``DeepseekV3ForCausalLM``.

Both models are built from the same ``ModelConfig`` (preset ``small-v3`` by default) with identical
weights: ours is initialised, written with ``save_pretrained`` and read back by transformers'
``from_pretrained``. Logits are compared in fp32 before anything is timed. MTP is switched off in ours
(``num_nextn_predict_layers=0``) because transformers has no MTP module.

Timing: each model runs its own training step: forward with the labels -> its own loss (mean next-token
cross-entropy, fp32) -> backward, gradients dropped after each step, in the same dtype, with the same
thread count, on a new batch every iteration (iteration i of every variant uses batch i), as training
does: a repeated batch repeats every expert's token count and so every matmul shape, which hides what
compiling CPU kernels for new shapes costs (``--fixed-batch`` to see it). Ours is ``model(tokens,
labels=labels)`` (the fused head + cross-entropy the trainer uses); transformers' is ``model(tokens,
labels=..., shift_labels=labels).loss`` (logits -> fp32 -> cross-entropy). "ours (logits + CE)" runs our
model through the transformers-style loss as well, so the two sources of the difference can be told
apart. "floor" runs ours with the attention replaced by a pass-through of the values and the loss by a
plain sum of the logits: what is left is the work both models do with the same ops (projections,
experts, head matmul, norms, routing), and transformers' step time over it is the largest lead that any
attention and loss implementation could give. Iterations of the variants are interleaved round-robin so
that load from other processes hits every variant alike; the median step time of each is
reported. transformers is measured with every experts implementation asked for (its default is
``grouped_mm``); the ratio is given against its default and its fastest.

    python benchmarks/bench_model_vs_hf.py                      # bf16, batch 4 x seq 512, 2 threads
    python benchmarks/bench_model_vs_hf.py --dtype fp32 --threads 1 --iters 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from seektrain.config.dtypes import dtype_from_name
from seektrain.models import build_model, get_preset
from seektrain.models.deepseek.hf_io import save_pretrained
from seektrain.platform import policy_for
from seektrain.train.balance import collect_expert_load

BENCH_DTYPES = ("bf16", "fp32")  # fp16 is not benchmarked


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def build_pair(preset: str, impls: list[str], seed: int, compute_dtype: torch.dtype = torch.bfloat16):
    """(our fp32 model with the CPU kernels for ``compute_dtype``, {impl: transformers fp32 model}) with
    identical weights."""
    import transformers

    cfg = get_preset(preset).replace(num_nextn_predict_layers=0)
    cpu_kernels = policy_for(torch.device("cpu")).model_kernels(compute_dtype)  # what training on CPU runs
    ours = build_model(cfg, dtype=torch.float32, seed=seed, kernels=cpu_kernels)
    theirs = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp, dtype=torch.float32)
        for impl in impls:
            try:
                theirs[impl] = transformers.AutoModelForCausalLM.from_pretrained(
                    tmp, dtype=torch.float32, experts_implementation=impl, attn_implementation="sdpa"
                )
            except (ValueError, KeyError, ImportError) as exc:
                print(f"  transformers experts_implementation={impl!r} unavailable: {exc}")
    return cfg, ours, theirs


LOGITS_TOLERANCE = 1e-3  # fp32 max |ours - transformers|; measured ~3e-6 on small-v3


def logits_diff(ours, theirs, vocab: int, device: torch.device | str = "cpu") -> float:
    """Max |ours - transformers| of the logits of one fixed batch (2 x 64 tokens), both in eval mode; run
    it with both models in fp32 (the models are left in eval mode: call ``.train()`` before training)."""
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        return (theirs(tokens).logits.float() - ours(tokens).logits.float()).abs().max().item()


def check_logits(ours, theirs: dict, vocab: int) -> None:
    for impl, model in theirs.items():
        diff = logits_diff(ours, model, vocab)
        status = "ok" if diff < LOGITS_TOLERANCE else "MISMATCH"
        print(f"  fp32 logits max |ours - transformers[{impl}]| = {diff:.2e}  {status}")
        if diff >= LOGITS_TOLERANCE:
            raise SystemExit("logits differ: the comparison would be meaningless")


def cast_model(model, dtype: torch.dtype):
    """Cast weights; the V3 balancing bias stays fp32 in both (as build_model and transformers keep it)."""
    model.to(dtype)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()
    return model


def _no_attention(q, k, v, scale, kernels=None, mask=None):
    """Stands in for our attention in the "floor" variant: passes the values through (keeps the graph)."""
    return v.transpose(1, 2).flatten(2) * 1.0


def make_step(model, kind: str):
    """A function of (tokens, labels) that runs one training step and returns the loss. kind: "fused"
    (our training forward), "logits" (our logits + fp32 CE), "hf" (transformers' loss), "floor" (ours with
    attention and the loss's softmax left out: the work both models do with the same ops, i.e. every
    projection, the experts, the head matmul, norms and routing)."""
    import seektrain.models.deepseek.attention as attention

    def step(tokens, labels):
        if kind == "fused":
            loss = model(tokens, labels=labels).loss_sum / labels.numel()
        elif kind == "floor":
            saved, attention._attend = attention._attend, _no_attention
            try:
                loss = model(tokens).logits.sum()
            finally:
                attention._attend = saved
        elif kind == "logits":
            loss = F.cross_entropy(model(tokens).logits.float().flatten(0, 1), labels.flatten())
        else:
            loss = model(tokens, labels=labels, shift_labels=labels).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        if kind != "hf":
            # As the trainer does after each step: read and reset our MoE's token counts. Left alone they
            # grow by one tensor per forward, and under torch.compile a guard on their length recompiles
            # the MoE blocks at every step.
            collect_expert_load(model, None)
        return loss

    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-v3")
    ap.add_argument("--dtype", choices=BENCH_DTYPES, default="bf16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6, help="timed iterations per model (interleaved)")
    ap.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc's default of unmapping freed big blocks (by default the process keeps freed "
        "memory, as `seektrain train` does on CPU; it applies to both models alike)",
    )
    ap.add_argument(
        "--hf-impls",
        default="grouped_mm,eager",
        help="transformers experts implementations to measure, comma-separated; the first is its "
        "default. batched_mm is left out by default: it gathers one copy of the expert "
        "weights per routed token (about 20 GB at batch 4 x seq 512) and runs out of memory "
        "on a small machine",
    )
    ap.add_argument(
        "--fixed-batch",
        action="store_true",
        help="train every iteration on the same batch (by default each iteration draws a new one, as "
        "training does: the same batch repeats the same tokens-per-expert counts and so the same "
        "matmul shapes, which hides what compiling kernels for new shapes costs)",
    )
    args = ap.parse_args(argv)

    import transformers

    from seektrain.platform.cpu_allocator import keep_freed_memory

    kept = not args.system_malloc and keep_freed_memory()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = dtype_from_name(args.dtype)
    impls = [s for s in args.hf_impls.split(",") if s]
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads={torch.get_num_threads()}, "
        f"cpu cores={os.cpu_count()}, freed memory kept: {kept}, load avg (1/5/15 min) at start: {load_avg()}"
    )
    print(
        f"model {args.preset} (MTP off: num_nextn_predict_layers=0), dtype {args.dtype}, "
        f"batch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens/step, "
        + (
            "the same batch every step"
            if args.fixed_batch
            else "a new batch every step (the same for every variant)"
        )
    )

    cfg, ours, theirs = build_pair(args.preset, impls, seed=0, compute_dtype=dtype)
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"  parameters: {n_params / 1e6:.1f}M")
    check_logits(ours, theirs, cfg.vocab_size)

    # iteration i of every variant trains on batch i; with --fixed-batch all iterations use batch 0
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(1 if args.fixed_batch else args.warmup + args.iters):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    def batch(i):
        return batches[0 if args.fixed_batch else i]

    cast_model(ours, dtype).train()
    steps = {
        "ours": make_step(ours, "fused"),
        "ours (logits + CE)": make_step(ours, "logits"),
        "floor (no attention, no CE)": make_step(ours, "floor"),
    }
    for impl, model in theirs.items():
        steps[f"transformers[{impl}]"] = make_step(cast_model(model, dtype).train(), "hf")

    losses = {}
    for name, step in steps.items():  # warm-up (also checks that losses agree)
        for i in range(args.warmup):
            losses[name] = float(step(*batch(i)))
    print(
        "  loss after warm-up: "
        + ", ".join(f"{k} {v:.4f}" for k, v in losses.items() if not k.startswith("floor"))
    )

    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(args.iters):
        order = names if i % 2 == 0 else names[::-1]  # alternate order: no variant always runs first
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            steps[name](*batch(args.warmup + i))
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    print(f"  load avg at end: {load_avg()}")

    ntok = args.batch * args.seq
    med = {name: statistics.median(ts) for name, ts in times.items()}
    med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    print()
    print(f"{'variant':28s} {'median s/step':>14s} {'min s/step':>11s} {'tokens/s':>10s} {'CPU s/step':>11s}")
    for name in names:
        print(
            f"{name:28s} {med[name]:14.3f} {min(times[name]):11.3f} {ntok / med[name]:10.0f} "
            f"{med_cpu[name]:11.3f}"
        )
    hf_names = [n for n in names if n.startswith("transformers")]
    if not hf_names:
        return 1
    default = hf_names[0]
    fastest = min(hf_names, key=lambda n: med[n])
    print()
    print(
        "ratio = transformers median step time / ours (tokens/s of ours over theirs); "
        "in brackets the same from CPU time and from the fastest step of each (less sensitive to load)"
    )
    floor = "floor (no attention, no CE)"
    print(
        f"floor: ours without attention and without the loss's softmax takes {med[floor]:.3f} s; the most "
        f"any attention + loss could make ours lead transformers' default by is "
        f"{med[default] / med[floor]:.2f}x [CPU time {med_cpu[default] / med_cpu[floor]:.2f}x]"
    )
    for ours_name in ("ours", "ours (logits + CE)"):
        for label, name in (("default", default), ("fastest", fastest)):
            print(
                f"{ours_name} vs transformers {label} ({name}): {med[name] / med[ours_name]:.2f}x  "
                f"[CPU time {med_cpu[name] / med_cpu[ours_name]:.2f}x, "
                f"best step {min(times[name]) / min(times[ours_name]):.2f}x]"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
