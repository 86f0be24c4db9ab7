"""LoRA against a full fine-tune of the same model on the same layout: peak memory per rank and tokens/s,
printed beside the planner's predicted peak.

    python benchmarks/bench_lora.py [--preset small-v3] [--seq 128] [--micro 1] [--steps 3] [--warmup 1]

Two spawned gloo ranks on this CPU (FSDP=2, one thread each) build both models as the trainer does
(``parallelize_model(build_model(..., device="meta"))``; LoRA: ``lora.enabled=true`` with its defaults,
rank 16 on attention, dense MLPs, shared and routed experts, base frozen in the compute dtype). Memory:
``MemTracker``'s peak of everything one training step holds (parameters, gradients, AdamW state,
activations and temporaries; the first step, which creates the optimizer state), per rank, against
``seektrain.plan.search.memory_breakdown``'s tensor total (its allowance for fragmentation left out).
Speed: forward + backward + AdamW step, the two sides interleaved step by step (their order alternating),
so that load from other jobs on the machine falls on both; the figure is global tokens per step over the
median step time after the warm-up. The CPU (``lscpu``), the thread count and the load average before
and after are printed: on a shared machine the speed figures are only comparable with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"full fine-tune": [], "LoRA": ["lora.enabled=true"]}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small-v3")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=1)
    return ap.parse_args()


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    return [
        f"train.seq_len={args.seq}",
        f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={2 * args.micro}",
        f"precision.dtype={args.dtype}",
        "parallel.dp_shard=2",
        *MODES[mode],
    ]


def _step(plan, model, optimizer, tokens) -> None:
    from seektrain.train.loss import model_loss

    kwargs = {"labels": tokens} if plan.fused_loss else {}
    if plan.use_mtp:
        kwargs["mtp_tokens"] = tokens
    loss, _ = model_loss(model(tokens, **kwargs), tokens, plan.job.train.mtp_loss_weight)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _peak_bytes(plan, pm, optimizer, tokens) -> int:
    """MemTracker's peak total of one step (frozen parameters get no gradient hook: it cannot place one)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    class _NoHook:
        def remove(self) -> None:
            pass

    class FrozenHooked(WeakIdKeyDictionary):
        def get(self, key, default=None):
            return (_NoHook(), _NoHook()) if not key.requires_grad else super().get(key, default)

    tracker = MemTracker()
    tracker._param_to_grad_hook_handles = FrozenHooked()
    tracker.track_external(*pm.parts, optimizer)
    with tracker:
        _step(plan, pm.model, optimizer, tokens)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return int(next(v for k, v in peak.items() if str(k) == "Total"))


def worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from seektrain.config.loader import load_config
    from seektrain.models import build_model
    from seektrain.models.deepseek.presets import get_preset
    from seektrain.parallel.mesh import build_meshes
    from seektrain.parallel.parallelize import parallelize_model
    from seektrain.plan.run_plan import RunPlan
    from seektrain.train.optim import build_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = get_preset(args.preset)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=gen)
    sides, result = {}, {}
    for mode in MODES:
        plan = RunPlan.resolve(load_config(None, overrides(args, mode)), cfg, 2, "cpu")
        kernels = plan.platform.model_kernels(plan.compute_dtype)
        pm = parallelize_model(
            build_model(plan.model, device="meta", kernels=kernels),
            plan,
            build_meshes(plan),
            torch.device("cpu"),
        )
        optimizer = build_optimizer(pm.model, plan.job.optim)
        result[mode] = {"peak_bytes": _peak_bytes(plan, pm, optimizer, tokens), "step_s": []}
        sides[mode] = (plan, pm.model, optimizer)
    for i in range(args.warmup + args.steps):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        for mode in order:
            plan, model, optimizer = sides[mode]
            dist.barrier()
            start = time.perf_counter()
            _step(plan, model, optimizer, tokens)
            dist.barrier()
            if i >= args.warmup:
                result[mode]["step_s"].append(time.perf_counter() - start)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def predicted_bytes(args: argparse.Namespace, mode: str) -> float:
    """The planner's per-rank tensor total for the same run (allowance for fragmentation left out)."""
    from seektrain.config.loader import load_config
    from seektrain.models.deepseek.presets import get_preset
    from seektrain.plan.hardware import cpu_hardware
    from seektrain.plan.run_plan import RunPlan
    from seektrain.plan.search import memory_breakdown

    plan = RunPlan.resolve(load_config(None, overrides(args, mode)), get_preset(args.preset), 2, "cpu")
    m = memory_breakdown(plan, cpu_hardware(2, measure=False))
    return m.total - m.allowance


def _cpu() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if "Model name" in line), "?")
    flags = [f for f in ("avx512_bf16", "amx_bf16") if f in text]
    return f"{name} ({os.cpu_count()} cores; {', '.join(flags) or 'no native bf16'})"


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    args = parse()
    print(f"CPU: {_cpu()}; torch {torch.__version__}; 2 gloo ranks × 1 thread, FSDP=2")
    print(f"load average before: {os.getloadavg()[0]:.1f} (other jobs on the machine share these cores)")
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(_free_port(), args, out), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    tokens = 2 * args.micro * args.seq
    print(
        f"\n{args.preset}, {args.dtype}, seq {args.seq}, {args.micro} sequence(s) per rank, "
        f"median of {args.steps} interleaved steps after {args.warmup} warm-up"
    )
    print(f"{'':16} {'peak MiB rank 0 / 1':>20} {'planner MiB':>12} {'error':>7} {'tokens/s':>9}")
    for mode in MODES:
        peaks = [r[mode]["peak_bytes"] for r in ranks]
        step = statistics.median(
            max(a, b) for a, b in zip(ranks[0][mode]["step_s"], ranks[1][mode]["step_s"])
        )
        pred = predicted_bytes(args, mode)
        print(
            f"{mode:16} {peaks[0] / 2**20:9.1f} / {peaks[1] / 2**20:8.1f} {pred / 2**20:12.1f} "
            f"{(pred / max(peaks) - 1) * 100:+6.1f}% {tokens / step:9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
