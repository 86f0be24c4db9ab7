"""DeepSpeed ZeRO-3 side of ``bench_fsdp_vs_deepspeed.py``: one worker, started by torchrun.

Trains our ``Transformer`` (same preset, same deterministic init and seed as ``seektrain train``) with
``deepspeed.initialize`` and a ZeRO-3 config: bf16 compute, fp32 master weights, AdamW with our
hyper-parameters and parameter groups (no decay on 1-D tensors), our warmup+cosine schedule, the same
gradient clipping, the same loss (next-token CE + weighted MTP CE) and the same V3 balancing-bias update
after every step. The forward is the trainer's: ``model(tokens, mtp_tokens=tokens, labels=labels)`` with
the fused head + cross-entropy, which reads ``lm_head.weight`` from the root module's forward, so it is
registered as a ZeRO-3 external parameter of the root. Other ZeRO settings are DeepSpeed's defaults for
stage 3 (overlap_comm on, small parameters kept whole below stage3_param_persistence_threshold), except
``--overlap-comm false`` to compare. Data: the built-in corpus through seektrain's own loader with the same
sequence length, micro batch, seed and rank sharding as ``seektrain train``, so both engines train on the
same batches (the tokens decide which experts run, and so the MoE's matmul shapes).

Writes one JSON line per rank to ``--out`` (rank suffix added): per-step times, tokens/s, peak RSS and
the bytes of parameters, gradients and optimizer state this rank holds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_bytes(engine) -> dict[str, int]:
    """Bytes this rank holds: bf16 parameter partitions, fp32 master partitions, fp32 gradient partitions
    and the Adam moments (walks DeepSpeed's ZeRO-3 optimizer; 0 where an attribute is missing)."""
    params = _tensor_bytes(p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor"))
    zopt = engine.optimizer
    master = _tensor_bytes(getattr(zopt, "fp32_partitioned_groups_flat", []) or [])
    grads = 0
    for flat in getattr(zopt, "fp32_partitioned_groups_flat", []) or []:
        if flat.grad is not None:
            grads += _tensor_bytes([flat.grad])
    grads = grads or _tensor_bytes(getattr(zopt, "averaged_gradients", {}).get(0, []) or [])
    inner = getattr(zopt, "optimizer", zopt)
    moments = sum(_tensor_bytes(v for v in st.values()) for st in inner.state.values())
    return {"param_bytes": params, "master_bytes": master, "grad_bytes": grads, "optim_state_bytes": moments}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small-v3")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--overlap-comm",
        choices=["true", "false"],
        default="true",
        help="ZeRO-3 overlap_comm (DeepSpeed's default for stage 3 is true)",
    )
    ap.add_argument(
        "--reduce-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="communication_data_type (seektrain's precision.reduce_dtype)",
    )
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="the allocator setting seektrain's CPU workers use (cpu.keep_freed_memory: keep "
        "freed memory during a step, malloc_trim after it)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from seektrain.platform import policy_for

    platform = policy_for(torch.device("cpu"))  # the CPU policy seektrain's workers use
    platform.prepare_process(deterministic=False, keep_freed_memory=args.keep_freed_memory)
    import deepspeed

    from seektrain.config.schema import JobConfig
    from seektrain.models import build_model, get_preset
    from seektrain.train.balance import collect_expert_load, update_balance_bias
    from seektrain.train.loss import model_loss
    from seektrain.train.optim import build_optimizer, build_scheduler
    from seektrain.train.setup_data import open_training_data

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = args.global_batch // (args.micro_batch * world)
    assert accum * args.micro_batch * world == args.global_batch, "global batch must divide evenly"
    job = JobConfig()  # seektrain's defaults; the data keys set to this run's below
    job.train.seq_len, job.train.micro_batch_size, job.train.seed = args.seq, args.micro_batch, args.seed
    train_defaults, optim_cfg = job.train, job.optim

    torch.manual_seed(args.seed)
    cfg = get_preset(args.preset)
    # same values as seektrain's init, and the same CPU kernels
    model = build_model(cfg, dtype=torch.float32, seed=args.seed, kernels=platform.model_kernels())
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, args.steps)
    ds_config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": train_defaults.grad_clip,
        "bf16": {"enabled": True},
        "communication_data_type": args.reduce_dtype,  # as our FSDP policy's reduce dtype
        "zero_optimization": {"stage": 3, "overlap_comm": args.overlap_comm == "true"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    # the fused loss uses the head's weight inside the root module's forward
    deepspeed.zero.register_external_parameter(model, model.lm_head.weight)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    use_mtp = cfg.num_nextn_predict_layers > 0 and train_defaults.mtp_loss_weight > 0
    speed = train_defaults.bias_update_speed if cfg.topk_method == "noaux_tc" else 0.0
    batches = open_training_data(job, cfg, dp_rank=rank, dp_size=world, is_main=rank == 0).loader
    dtype = next(engine.module.parameters()).dtype

    times, losses = [], []
    for _step in range(args.steps):
        t0 = time.perf_counter()
        for _ in range(accum):
            batch = next(batches)
            tokens, labels = batch.tokens, batch.labels
            out = engine(tokens, mtp_tokens=tokens if use_mtp else None, labels=labels)
            loss, _parts = model_loss(out, labels, train_defaults.mtp_loss_weight)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
        update_balance_bias(engine.module, collect_expert_load(engine.module, dist.group.WORLD), speed)
        platform.end_of_step()  # as seektrain's trainer does at the end of each step
        loss_t = loss.detach().float().reshape(1)
        dist.all_reduce(loss_t)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss_t) / world)
        if rank == 0:
            print(
                f"[deepspeed] step {_step + 1}/{args.steps} loss {losses[-1]:.4f} {times[-1]:.2f}s",
                flush=True,
            )

    timed = times[args.warmup :] or times
    tokens_per_step = args.global_batch * args.seq
    record = {
        "rank": rank,
        "world_size": world,
        "threads": torch.get_num_threads(),
        "param_dtype": str(dtype),
        "step_times_s": times,
        "losses": losses,
        "median_step_s": statistics.median(timed),
        "tokens_per_s": tokens_per_step / statistics.median(timed),
        "peak_rss_gib": _peak_rss_gib(),
        **_state_bytes(engine),
        "n_params": sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()
        ),
    }
    with open(f"{args.out}.rank{rank}", "w") as fh:
        fh.write(json.dumps(record) + "\n")
    dist.barrier()


if __name__ == "__main__":
    main()
