"""Pipeline bubble of each schedule, measured next to its theory.

    python benchmarks/bench_pipeline_bubble.py [--microbatches 2 4 8] [--steps 3] [--warmup 2]

Launches itself under torchrun with ``p = 2`` gloo workers (``OMP_NUM_THREADS=1`` each, so each rank is
one core) and, for every schedule (gpipe, 1f1b, interleaved-1f1b, zbv) and micro-batch count ``m``,
trains a dense Llama-architecture model (vocab 320, hidden 512 by default: big enough that one stage's
forward of one micro-batch takes ~100 ms while the activation sent between ranks is ~0.5 MB) with the
stages seektrain itself builds (the run plan's layer split, ``pipeline.rank_stages`` /
``build_schedule``).

What is measured. Each rank times the compute of its stage(s): every ``PipelineStage.forward_one_chunk``
(the stage module's forward), ``backward_one_chunk`` (full backward, or the input-gradient half under
zbv), ``backward_weight_one_chunk`` (zbv's weight-gradient half) and the loss function, all wrapped with
``perf_counter``. A step is ``barrier; schedule.step(...); barrier`` so every rank shares the same step
time ``T`` (that of the slowest rank). The bubble of a rank is ``1 - compute / T``: all the time it is
not computing (waiting for a neighbour, P2P transfers, schedule bookkeeping). Warm-up steps (the first
runs shape inference) are dropped; the table shows the median over ranks × measured steps.

Theory (equal stages, communication free):
- gpipe, 1f1b: ``(p-1)/(m+p-1)`` (1F1B changes the memory, not the bubble).
- interleaved-1f1b with ``v`` stages per rank: ``(p-1)/(v·m+p-1)``.
- zbv (zero-bubble V, Qi et al. 2024, two stages per rank in a V, backward split into input-grad B and
  weight-grad W): no closed form in ``m`` alone; with ``T_F = T_B = T_W`` the V schedule is bubble-free in
  the steady state and its warm-up/cool-down bubble is filled by deferred W's once ``m >= 2p``. The
  "slot model" column gives, for every schedule, the idle fraction of the schedule's own action table
  (``schedule.pipeline_order``, one slot per F / B / W action; gpipe/1f1b have none in torch, so the
  closed form is used there). For zbv that column is the theory under ``T_F = T_B = T_W``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

P = 2  # pipeline ranks
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zbv"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per (schedule, m)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mb", type=int, default=2, help="sequences per micro-batch (fixed; m varies the batch)")
    ap.add_argument("--threads", type=int, default=1, help="OMP/intra-op threads per rank")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def theory(schedule: str, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (m + P - 1)
    if schedule == "interleaved-1f1b":
        return (P - 1) / (v * m + P - 1)
    return None


def slot_model(order: dict | None) -> float | None:
    """Mean idle fraction of the ranks' action tables (None entries and a shorter table are idle)."""
    if not order:
        return None
    length = max(len(ops) for ops in order.values())
    return statistics.mean(1 - sum(a is not None for a in ops) / length for ops in order.values())


class Timer:
    def __init__(self):
        self.seconds = {"F": 0.0, "B": 0.0, "W": 0.0, "loss": 0.0}

    def wrap(self, key: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0

        return timed

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from seektrain.config.loader import load_config
    from seektrain.models import build_model
    from seektrain.models.config import ModelConfig
    from seektrain.parallel import pipeline
    from seektrain.parallel.mesh import build_meshes
    from seektrain.plan.run_plan import RunPlan
    from seektrain.train.loss import model_loss

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == P, f"run with {P} ranks"
    device = torch.device("cpu")
    cfg = ModelConfig(
        name=f"bench-dense-h{args.hidden}-l{args.layers}",
        arch="llama",
        vocab_size=320,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=4096,
    ).validate()
    gen = torch.Generator().manual_seed(0)
    results = []
    for schedule in args.schedules:
        for m in args.microbatches:
            # the plan seektrain train would resolve: P stages of 2 per rank under the multi-stage schedules
            job = load_config(
                None,
                [
                    f"parallel.pp={P}",
                    "parallel.dp_shard=1",
                    f"parallel.pp_schedule={schedule}",
                    "parallel.pp_stages_per_rank=2",
                    f"parallel.pp_microbatches={m}",
                    f"train.micro_batch_size={args.mb}",
                    f"train.global_batch_size={m * args.mb}",
                ],
            )
            plan = RunPlan.resolve(job, cfg, world, "cpu")
            per_rank, bounds = plan.pp_stages_per_rank, plan.pp_stage_layers
            parts, ids = pipeline.rank_stages(build_model(cfg, device="meta"), plan, rank)
            for part in parts:
                part.to_empty(device=device)
                part.init_weights(1234)
            timer = Timer()
            loss_fn = timer.wrap(
                "loss", lambda out, labels: model_loss(pipeline.from_wire(out), labels, 0.0)[0]
            )
            sched = pipeline.build_schedule(parts, ids, plan, build_meshes(plan), device, loss_fn)
            stages = getattr(sched, "_stages", None) or [sched._stage]
            for st in stages:
                st.forward_one_chunk = timer.wrap("F", st.forward_one_chunk)
                st.backward_one_chunk = timer.wrap("B", st.backward_one_chunk)
                st.backward_weight_one_chunk = timer.wrap("W", st.backward_weight_one_chunk)
            first, last = 0 in ids, (len(bounds) - 1) in ids
            rows = []
            for step in range(args.warmup + args.steps):
                tokens = torch.randint(0, cfg.vocab_size, (m * args.mb, args.seq), generator=gen)
                labels = torch.randint(0, cfg.vocab_size, (m * args.mb, args.seq), generator=gen)
                timer.reset()
                dist.barrier()
                t0 = time.perf_counter()
                step_args = (tokens,) if first else ()
                if last:
                    sched.step(*step_args, target=labels, losses=[])
                else:
                    sched.step(*step_args)
                dist.barrier()
                wall = time.perf_counter() - t0
                for p in parts:
                    p.zero_grad(set_to_none=True)
                compute = sum(timer.seconds.values())
                rows.append({"step": step, "wall": wall, "compute": compute, **timer.seconds})
            gathered = [None] * world
            dist.all_gather_object(gathered, rows)
            if rank == 0:
                measured = [r for ranks in gathered for r in ranks[args.warmup :]]
                bubbles = [1 - r["compute"] / r["wall"] for r in measured]
                per_rank_bubble = [
                    statistics.median(1 - r["compute"] / r["wall"] for r in rk[args.warmup :])
                    for rk in gathered
                ]
                steady = measured
                res = {
                    "schedule": schedule,
                    "m": m,
                    "v": per_rank,
                    "bubble_median": statistics.median(bubbles),
                    "bubble_per_rank": per_rank_bubble,
                    "theory": theory(schedule, m, per_rank),
                    # torch's single-stage tables (gpipe, 1f1b) list no idle slots: no slot model there
                    "slot_model": slot_model(sched.pipeline_order) if hasattr(sched, "_stages") else None,
                    "step_s": statistics.median(r["wall"] for r in gathered[0][args.warmup :]),
                    "F_ms_per_mb_stage": 1e3 * statistics.median(r["F"] for r in steady) / (m * per_rank),
                    "B_ms_per_mb_stage": 1e3 * statistics.median(r["B"] for r in steady) / (m * per_rank),
                    "W_ms_per_mb_stage": 1e3 * statistics.median(r["W"] for r in steady) / (m * per_rank),
                    "layers_per_stage": [len(b) for b in bounds],
                }
                results.append(res)
                print(json.dumps(res), flush=True)
            del sched, parts
            dist.barrier()
    if rank == 0:
        print(
            "RESULTS "
            + json.dumps(
                {
                    "results": results,
                    "model": cfg.name,
                    "seq": args.seq,
                    "mb": args.mb,
                    "threads": args.threads,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={P}",
        __file__,
        "--worker",
        *sys.argv[1:],
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    load_after = os.getloadavg()
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"workers failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    data = json.loads(line[len("RESULTS ") :])
    print(
        f"p={P} gloo ranks, {args.threads} thread(s) each, {os.cpu_count()} CPU cores; model {data['model']} "
        f"(llama, vocab 320), micro-batch {args.mb}x{args.seq} tokens, fp32; {args.warmup} warm-up + "
        f"{args.steps} measured steps"
    )
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); run took {elapsed:.0f} s"
    )
    print()
    head = (
        f"| {'schedule':<16} | {'m':>2} | {'layers/stage':<12} | {'measured bubble':>15} | {'per rank':>13} | "
        f"{'theory':>7} | {'slot model':>10} | {'step s':>6} | {'F/B/W ms per mb·stage':<21} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in data["results"]:
        per = "/".join(f"{100 * b:.0f}%" for b in r["bubble_per_rank"])
        fbw = f"{r['F_ms_per_mb_stage']:.0f}/{r['B_ms_per_mb_stage']:.0f}/{r['W_ms_per_mb_stage']:.0f}"
        layers = ",".join(map(str, r["layers_per_stage"]))
        print(
            f"| {r['schedule']:<16} | {r['m']:>2} | {layers:<12} | {fmt(r['bubble_median']):>15} | {per:>13} | "
            f"{fmt(r['theory']):>7} | {fmt(r['slot_model']):>10} | {r['step_s']:6.2f} | {fbw:<21} |"
        )
    print()
    print(
        "theory: gpipe/1f1b (p-1)/(m+p-1); interleaved-1f1b (p-1)/(v*m+p-1), v=2; zbv: none in closed form -"
    )
    print("the slot model (idle share of torch's own action table, one slot per F, B, W) is its theory for")
    print(
        "T_F = T_B = T_W. Measured bubble = 1 - (time in stage forward/backward/weight-grad/loss) / step time,"
    )
    print("median over ranks x measured steps (per rank: rank0/rank1).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**data, "load_before": load_before, "load_after": load_after}, f, indent=1)


if __name__ == "__main__":
    main()
