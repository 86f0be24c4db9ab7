"""Context parallelism on CPU processes: peak activation memory per rank and tokens/s at one long
sequence with cp = 1, 2 and 4, each beside the planner's figure.

    python benchmarks/bench_context_parallel.py [--preset tiny-v3] [--seq 4096] [--steps 3] [--json F]

For each cp, ``cp`` spawned gloo ranks (one torch thread each) build the model as the trainer does
(``parallelize_model(build_model(..., device="meta"), plan, meshes, device)``, ``parallel.cp=cp``,
``dp_shard=1``: the ``cp`` ranks share one sequence and FSDP-shard the one replica), then:

- memory: one forward + backward of this rank's chunks of one sequence under ``MemTracker``; the peak of
  its ACT + TEMP (activations, the ring's buffers, FSDP's gathered parameters and unsharded gradients),
  beside the planner's ``transient_bytes`` of the same plan (activations + communication buffers);
- speed: ``--steps`` timed steps (forward, backward, AdamW) after one warm-up; tokens/s is the
  sequence's tokens per step over the median step time, beside the planner's ``step_time`` on
  ``--gpu cpu`` hardware (this host measured, split over the ranks).

With more ranks than cores the workers time-share the CPU: the tokens/s column then measures
contention and gloo over shared memory as much as the ring. The CPU model (``lscpu``) and the load
average are printed with the figures; another job on the machine shows up there.
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

import torch
import torch.distributed as dist


def _overrides(args, cp: int) -> list[str]:
    return [
        f"model.preset={args.preset}",
        f"train.seq_len={args.seq}",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        f"precision.dtype={args.dtype}",
        f"parallel.cp={cp}",
        "parallel.dp_shard=1",
    ]


def _plan(args, cp: int, device_type: str = "cpu"):
    from seektrain.config.loader import load_config
    from seektrain.models.job_model import configured_model_config
    from seektrain.plan.run_plan import RunPlan

    job = load_config(None, _overrides(args, cp))
    return RunPlan.resolve(job, configured_model_config(job), cp, device_type)


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from seektrain.data.batch import Batch
    from seektrain.models import build_model
    from seektrain.parallel.context_parallel import local_batch
    from seektrain.parallel.mesh import build_meshes
    from seektrain.parallel.parallelize import parallelize_model
    from seektrain.train.loss import model_loss
    from seektrain.train.optim import build_optimizer
    from seektrain.train.step import model_inputs

    args = argparse.Namespace(**json.loads((Path(out_dir) / "args.json").read_text()))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.cp)
    plan = _plan(args, args.cp)
    device = torch.device("cpu")
    kernels = plan.platform.model_kernels(plan.compute_dtype)
    meshes = build_meshes(plan)
    meta = build_model(plan.model, device="meta", kernels=kernels)
    model = parallelize_model(meta, plan, meshes, device).model
    optimizer = build_optimizer(model, plan.job.optim)
    tokens = torch.randint(
        0, plan.model.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)
    )
    batch = local_batch(plan, meshes, Batch(tokens=tokens, labels=tokens))
    weight = plan.job.train.mtp_loss_weight

    def step(with_optimizer: bool) -> None:
        with plan.autocast(device), plan.loss_context():
            loss, _ = model_loss(model(batch.tokens, **model_inputs(plan, batch)), batch.labels, weight)
            loss.backward()
        if with_optimizer:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step(False)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    acts = sum(v for k, v in peak.items() if str(k).endswith(("ACT", "TEMP")))
    optimizer.zero_grad(set_to_none=True)
    step(True)  # warm-up
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"activations": acts, "step_s": times}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _predicted(args, cp: int, hw) -> tuple[float, float]:
    """(the planner's activation + communication-buffer bytes, its tokens/s) for the plan of ``cp``."""
    from seektrain.plan.memory import transient_bytes
    from seektrain.plan.speed import step_time

    plan = _plan(args, cp)
    return transient_bytes(plan)[2], args.seq / step_time(plan, hw).total_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-v3")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--cps", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from seektrain.plan.hardware import cpu_hardware

    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?"
    )
    print(f"CPU: {model_name}, {os.cpu_count()} cores; load average {os.getloadavg()}")
    print(f"{args.preset}, one sequence of {args.seq} tokens, {args.dtype}, {args.steps} timed steps")
    rows = []
    for cp in args.cps:
        hw = cpu_hardware(cp)  # this host's probe, split over the cp ranks (one node)
        with tempfile.TemporaryDirectory() as out:
            (Path(out) / "args.json").write_text(json.dumps({**vars(args), "cp": cp}))
            mp.start_processes(_worker, args=(free_port(), out), nprocs=cp, start_method="spawn")
            ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(cp)]
        acts = max(r["activations"] for r in ranks)
        step_s = statistics.median(max(ts) for ts in zip(*(r["step_s"] for r in ranks)))
        pred_acts, pred_tps = _predicted(args, cp, hw)
        row = {
            "cp": cp,
            "peak_activations_mib": acts / 2**20,
            "predicted_mib": pred_acts / 2**20,
            "tokens_per_s": args.seq / step_s,
            "predicted_tokens_per_s": pred_tps,
            "load_after": os.getloadavg()[0],
        }
        rows.append(row)
        print(
            f"cp={cp}: peak activations per rank {row['peak_activations_mib']:.1f} MiB "
            f"(planner {row['predicted_mib']:.1f} MiB, {(pred_acts / acts - 1) * 100:+.1f}%); "
            f"{row['tokens_per_s']:,.0f} tokens/s (planner {pred_tps:,.0f}); load {row['load_after']:.2f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": model_name, "args": vars(args), "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
