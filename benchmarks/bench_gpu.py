"""GPU speed of seektrain on one device (issue 14): tokens/s, MFU and peak memory of a dense and a MoE
model, side by side, in one command.

Rows, for each model (docs/benchmarks.md, "GPU benchmark", says what each measures):

* ours fwd+bwd, eager / with ``train.compile``'s regional compile (``seektrain.parallel.compile``; its
  compile time is reported apart) — the bare model in bf16, our fused head + cross-entropy;
* transformers fwd+bwd on the same weights (``save_pretrained`` -> ``AutoModelForCausalLM``, sdpa), after
  checking the fp32 logits agree;
* the trainer (``python -m seektrain.cli.main train``, one rank: fp32 master weights, bf16 autocast, AdamW),
  bf16 and ``precision.fp8=rowwise`` (only where that key, torchao and an FP8 GPU exist; otherwise the
  row says why), read from the run's ``metrics.jsonl``;
* context parallelism's ring attention on one rank against plain attention at the model's attention
  shape (``bench_gpu_ring.py``: the ring's CUDA block kernels checked against plain attention, then
  timed; attention alone);
* and, for the dense model, the stall of one synchronous and one asynchronous checkpoint save through
  the trainer's ``CheckpointManager``.

Timing: ``torch.cuda.synchronize`` around each step, medians of ``--iters`` timed steps after
``--warmup``, a new random batch every step. MFU = tokens/s x model FLOPs per token
(``seektrain.observe.flops``) / the device's dense bf16 peak (``seektrain/plan/hardware.py``; 989.4
TFLOP/s for the H200). ``--smoke`` runs every row with tiny shapes on the CPU (MFU against the cpu
entry: a peak measured here) so the script's logic is tested without a GPU.

    python benchmarks/bench_gpu.py --out bench_gpu.json          # GPU: 1.23B dense + 2.05B MoE, 4 x 4096
    python benchmarks/bench_gpu.py --smoke                        # CPU, tiny shapes, about a minute
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench_gpu_common import (
    MODEL_ROWS,
    MODELS,
    ROOT,
    ROWS,
    TARGETS,
    Results,
    free_memory,
    peak_mem_gib,
    reset_peak,
    run_row,
    sync,
)

if str(ROOT) not in sys.path:  # the checkout this script belongs to, also where seektrain is not installed
    sys.path.insert(0, str(ROOT))

import torch

from bench_model_vs_hf import LOGITS_TOLERANCE, cast_model, logits_diff, make_step
from seektrain.models import ModelConfig, build_model, count_params, get_preset
from seektrain.models.deepseek.hf_io import from_pretrained, save_pretrained
from seektrain.observe.flops import model_flops_per_token
from seektrain.platform import policy_for


# ----------------------------------------------------------------------------- the two models
def dense_config(smoke: bool, seq: int) -> ModelConfig:
    """Llama shape, 1.23B parameters (DeepSeek-LLM's vocabulary)."""
    if smoke:
        return ModelConfig(
            name="bench-dense-smoke",
            arch="llama",
            vocab_size=512,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=seq,
        )
    return ModelConfig(
        name="bench-dense-1.2b",
        arch="llama",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=seq,
    )


def moe_config(smoke: bool, seq: int) -> ModelConfig:
    """DeepSeek-V3's shape at hidden 1536: MLA with V3's head dims and ranks (q_lora 1536, kv_lora 512,
    qk 128 + 64 rope, v 128), 16 heads, sigmoid routing with the balancing bias, 64 routed experts of
    width 768 in 8 groups (top-4 groups), top-6 + 1 shared, layer 0 dense (V3 keeps its first 3 of 61
    dense), no MTP; vocabulary 102400 (the dense model's) puts the total at 2.05B, 0.46B activated."""
    if smoke:
        return get_preset("tiny-v3").replace(
            name="bench-moe-smoke",
            vocab_size=512,
            num_hidden_layers=2,
            max_position_embeddings=seq,
            num_nextn_predict_layers=0,
        )
    return ModelConfig(
        name="bench-moe-2b",
        arch="deepseek_v3",
        vocab_size=102400,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=seq,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=6,
        moe_intermediate_size=768,
        first_k_dense_replace=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
    )


# ----------------------------------------------------------------------------- environment facts
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def device_facts(device: torch.device) -> dict:
    """Name, hardware-table entry and dense bf16 peak (FLOP/s) of the device: the GPU's datasheet entry
    in seektrain/plan/hardware.py, or on a CPU the table's cpu entry (a matmul peak measured here)."""
    from seektrain.plan.hardware import GPUS, cpu_hardware, name_from_device

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = name_from_device(name)
        facts = {
            "type": "cuda",
            "name": name,
            "hardware": key,
            "capability": list(torch.cuda.get_device_capability(device)),
        }
        if key is None:
            return {
                **facts,
                "peak_bf16_flops": None,
                "peak_source": "not in seektrain/plan/hardware.py: MFU is not computed",
            }
        return {**facts, "peak_bf16_flops": GPUS[key].bf16_tflops * 1e12, "peak_source": GPUS[key].source}
    hw = cpu_hardware(1)
    return {
        "type": "cpu",
        "name": cpu_name(),
        "hardware": "cpu",
        "threads": torch.get_num_threads(),
        "peak_bf16_flops": hw.bf16_tflops * 1e12,
        "peak_source": hw.source,
    }


def versions() -> dict:
    from importlib import metadata

    import transformers

    def dist_version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "torchao": dist_version("torchao"),
    }


def commit() -> dict:
    """The checkout's commit (``git rev-parse``), else ``$SEEKTRAIN_COMMIT`` (a copied tree has no .git)."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=20
        )
        if sha.returncode == 0:
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=20,
            )
            return {
                "sha": sha.stdout.strip(),
                "dirty": bool(status.stdout.strip()),
                "source": "git rev-parse",
            }
    except (OSError, subprocess.SubprocessError):
        pass
    env = os.environ.get("SEEKTRAIN_COMMIT")
    if env:
        return {"sha": env, "dirty": None, "source": "SEEKTRAIN_COMMIT"}
    return {"sha": None, "dirty": None, "source": "unknown: no git checkout and SEEKTRAIN_COMMIT unset"}


# ----------------------------------------------------------------------------- bare-model rows
def make_batches(vocab: int, batch: int, seq: int, n: int, device: torch.device) -> list[tuple]:
    """``n`` random (tokens, labels) batches on the device, made before timing: step i trains on batch i."""
    gen = torch.Generator(device=device).manual_seed(1)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=gen, device=device)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def time_steps(step, batches: list, warmup: int, device: torch.device) -> tuple[list[float], float, float]:
    """Wall time of each step (synchronised), the warm-up ones left out; also the first step's time and
    loss (the loss of batch 0, the same for every row)."""
    times, first, first_loss = [], 0.0, float("nan")
    sync(device)
    for i, (tokens, labels) in enumerate(batches):
        t0 = time.perf_counter()
        loss = step(tokens, labels)
        sync(device)
        dt = time.perf_counter() - t0
        if i == 0:
            first, first_loss = dt, float(loss)
        if i >= warmup:
            times.append(dt)
    return times, first, first_loss


def speed(
    times: list[float], tokens_per_step: int, flops_per_token: float, peak: float | None, device: torch.device
) -> dict:
    med = statistics.median(times)
    tps = tokens_per_step / med
    return {
        "tokens_per_s": tps,
        "mfu": tps * flops_per_token / peak if peak else None,
        "step_s_median": med,
        "step_s": times,
        "peak_mem_gib": peak_mem_gib(device),
    }


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def bare_rows(
    results: Results,
    key: str,
    cfg: ModelConfig,
    hf_dir: Path,
    args,
    device: torch.device,
    peak: float | None,
    selected: set[str],
) -> None:
    """Our model eager, transformers' on the same (bf16) weights, then ours regionally compiled (last:
    compiling changes the model in place). The Hugging Face folder written here is also what the trainer
    rows start from."""
    import transformers

    from seektrain.parallel.compile import apply_compile

    flops = model_flops_per_token(cfg, args.seq)
    tokens_per_step = args.batch * args.seq
    n_steps = args.warmup + args.iters
    ours = build_model(
        cfg, device=device, dtype=torch.float32, seed=0, kernels=policy_for(device).model_kernels()
    )
    cast_model(ours, torch.bfloat16)  # bf16 weights (the balancing bias stays fp32), as saved below
    save_pretrained(ours, hf_dir, dtype=torch.bfloat16)
    batches = make_batches(cfg.vocab_size, args.batch, args.seq, n_steps, device)
    model_facts = results.data["models"][key]

    def eager():
        reset_peak(device)
        ours.train()
        times, _, loss = time_steps(make_step(ours, "fused"), batches, args.warmup, device)
        return {**speed(times, tokens_per_step, flops, peak, device), "first_loss": loss}

    def compiled():
        from torch._dynamo.utils import counters

        reset_peak(device)
        ours.train()
        blocks = apply_compile(ours)
        counters.clear()
        times, first, _ = time_steps(make_step(ours, "fused"), batches, args.warmup, device)
        return {
            **speed(times, tokens_per_step, flops, peak, device),
            "compile_s": first,
            "compiled_blocks": blocks,
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": dict(counters["graph_break"]),
            "note": "compile_s: wall time of the first fwd+bwd, compilation included; graphs: distinct graphs "
            "compiled over all steps (a block type with no graph break is one)",
        }

    def theirs_row():
        # The logits check runs on the CPU in fp32, as bench_model_vs_hf.py's does: transformers' model and
        # ours read back from the same folder (on the GPU, fp32 experts would take other kernels than the
        # bf16 ones timed; the first-step bf16 losses on the GPU are compared below as well).
        experts = {"experts_implementation": args.hf_experts} if args.hf_experts and cfg.is_moe else {}
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="sdpa", **experts
        )
        reference = from_pretrained(hf_dir, dtype=torch.float32)
        diff = logits_diff(reference, theirs, cfg.vocab_size, "cpu")
        del reference
        facts = {
            "logits_max_abs_diff_fp32": diff,
            "class": type(theirs).__name__,
            "experts_implementation": getattr(theirs.config, "_experts_implementation", None),
            "attn_implementation": getattr(theirs.config, "_attn_implementation", None),
        }
        if not diff < LOGITS_TOLERANCE:
            return {
                **facts,
                "error": f"fp32 logits differ from ours by {diff:.2e} (>= {LOGITS_TOLERANCE}): "
                "the comparison would be meaningless",
            }
        theirs = cast_model(theirs.to(device), torch.bfloat16).train()
        reset_peak(device)
        times, _, loss = time_steps(make_step(theirs, "hf"), batches, args.warmup, device)
        result = {**speed(times, tokens_per_step, flops, peak, device), **facts, "first_loss": loss}
        if device.type == "cuda":  # our model sits on the GPU meanwhile: its bytes are not transformers'
            result["peak_mem_gib"] -= _bytes(ours) / 2**30
            result["note"] = "peak_mem_gib: max_memory_allocated less our model's weights, resident meanwhile"
        del theirs
        return result

    model_facts["hf_dir_bytes"] = sum(p.stat().st_size for p in hf_dir.iterdir())
    try:
        run_row(results, key, "eager", selected, eager, device)
        run_row(results, key, "transformers", selected, theirs_row, device)
        run_row(results, key, "compiled", selected, compiled, device)  # last: compiles ours in place
    finally:
        ours = batches = None  # frees them: the row functions above hold them too
        torch._dynamo.reset()
        free_memory(device)


# ----------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny shapes (hidden 128, 2 layers, 2 x 128 tokens)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON file of every figure (default: $OUT/bench_gpu.json when $OUT is set)",
    )
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (4; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (4096; smoke 128)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (3; smoke 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps, median reported (10; smoke 2)")
    ap.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}"
    )
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    ap.add_argument(
        "--hf-experts",
        default=None,
        help="transformers' experts_implementation for the MoE model (default: transformers' own default; "
        "the JSON records which it used)",
    )
    ap.add_argument(
        "--trainer-compile",
        choices=("on", "off"),
        default=None,
        help="train.compile in the trainer rows (on; smoke off: the compiled row already covers it)",
    )
    ap.add_argument(
        "--trainer-timeout", type=float, default=300.0, help="seconds before a trainer row is stopped"
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where Hugging Face folders, data, run dirs and checkpoints go (default: a new temp dir, "
        "removed at the end)",
    )
    args = ap.parse_args(argv)
    smoke = args.smoke
    args.batch = args.batch or (2 if smoke else 4)
    args.seq = args.seq or (128 if smoke else 4096)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    args.iters = args.iters or (2 if smoke else 10)
    args.trainer_compile = (args.trainer_compile or ("off" if smoke else "on")) == "on"
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / "bench_gpu.json"
    for name, chosen, known in (("--models", args.models, MODELS), ("--rows", args.rows, ROWS)):
        bad = set(chosen.split(",")) - set(known)
        if bad:
            ap.error(f"{name}: unknown {', '.join(sorted(bad))}; choose from {', '.join(known)}")
    return args


def main(argv=None) -> int:
    import shutil

    from bench_gpu_checkpoint import checkpoint_rows
    from bench_gpu_report import print_report
    from bench_gpu_trainer import prepare_data

    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA GPU is visible: run on a GPU, or pass --smoke for the CPU check of the script"
        )
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    selected = set(args.rows.split(","))
    facts = device_facts(device)
    results = Results(
        args.out,
        {
            "smoke": args.smoke,
            "device": facts,
            "versions": versions(),
            "commit": commit(),
            "settings": {
                "batch": args.batch,
                "seq": args.seq,
                "tokens_per_step": args.batch * args.seq,
                "warmup": args.warmup,
                "iters": args.iters,
                "dtype": "bf16",
                "trainer_compile": args.trainer_compile,
                "models": args.models,
                "rows": args.rows,
            },
            "targets": TARGETS,
        },
    )
    print(
        f"device {facts['name']} ({facts['hardware']}), dense bf16 peak "
        + (f"{facts['peak_bf16_flops'] / 1e12:.1f} TFLOP/s" if facts["peak_bf16_flops"] else "unknown")
        + f"; torch {results.data['versions']['torch']}, transformers {results.data['versions']['transformers']}, "
        f"torchao {results.data['versions']['torchao']}; commit {results.data['commit']['sha']}",
        flush=True,
    )

    # A time limit's SIGTERM unwinds like an exception: the trainer row in flight kills its process group
    # (which is in a session of its own), the work folder goes, and the report covers what was measured.
    signal.signal(signal.SIGTERM, _terminated)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        vocab = min(
            (dense_config if k == "dense" else moe_config)(args.smoke, args.seq).vocab_size
            for k in args.models.split(",")
        )
        data_dir = prepare_data(work / "data", args, vocab)
        for key in args.models.split(","):
            model_rows(results, key, data_dir, work, args, device, selected)
            if key == "dense":  # the dense model's checkpoint stalls, before the next model's rows
                checkpoint_rows(results, dense_config(args.smoke, args.seq), work, device, selected)
    except (KeyboardInterrupt, SystemExit) as stop:
        results.data["interrupted"] = f"{type(stop).__name__} {stop}".strip()
        print(
            f"\ninterrupted ({results.data['interrupted']}): the report below has the rows measured so far",
            flush=True,
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        results.data["wall_s"] = time.perf_counter() - results.t0
        print_report(results.data)  # also adds the ratios the targets speak of
        results.write()
        if args.out is not None:
            print(f"\nfigures: {args.out}")
    return 1 if "interrupted" in results.data else 0


def _terminated(signum, frame):
    raise SystemExit(f"signal {signum}")


def model_rows(
    results: Results, key: str, data_dir: Path, work: Path, args, device: torch.device, selected: set[str]
) -> None:
    """Every row of one model; a failure outside a row (building, saving) marks the rows left undone."""
    import shutil

    from bench_gpu_ring import ring_row
    from bench_gpu_trainer import trainer_rows

    cfg = (dense_config if key == "dense" else moe_config)(args.smoke, args.seq)
    counts = count_params(cfg)
    flops = model_flops_per_token(cfg, args.seq)
    results.model(
        key,
        {
            "config": cfg.to_dict(),
            "params_total": counts.total,
            "params_active": counts.active,
            "flops_per_token": flops,
        },
    )
    print(
        f"{key}: {cfg.name}, {counts.total:,} parameters ({counts.active:,} activated without the embedding), "
        f"{flops / 1e9:.3f} GFLOP/token",
        flush=True,
    )
    hf_dir = work / f"hf-{key}"
    try:
        bare_rows(
            results, key, cfg, hf_dir, args, device, results.data["device"]["peak_bf16_flops"], selected
        )
        trainer_rows(results, key, hf_dir, data_dir, work, args, device, selected)
        peak = results.data["device"]["peak_bf16_flops"]
        run_row(results, key, "ring", selected, lambda: ring_row(cfg, args, device, peak), device)
    except Exception as err:
        traceback.print_exc()
        for row in MODEL_ROWS:
            if row not in results.data["rows"][key]:
                results.row(key, row, {"error": f"{type(err).__name__}: {err}"[:500]})
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
        free_memory(device)


if __name__ == "__main__":
    sys.exit(main())
