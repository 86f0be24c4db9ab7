"""The rank-sharded Hugging Face load at the largest size this machine holds: peak resident memory per
rank beside the rank's own share of the model, and load time beside the raw read time of the same files.

    python benchmarks/bench_hf_load.py [--dir /tmp/bench-hf-load] [--hidden 1024 --layers 16 --experts 128]

It writes a DeepSeek-V3-shaped model (MLA, 128 routed experts, an MTP layer; 1.72B parameters at the
defaults) twice in the release layout, many shards with an index: bf16 (3.4 GB), and FP8 e4m3 projections
with 128x128 block scales (as DeepSeek-V3's release). Then each layout loads it the trainer's way
(``RunPlan`` + ``parallelize_model(..., hf_path=...)`` on a meta model, fp32 master weights; spawned
gloo ranks, one compute thread each, the loader's 4 read threads), the page cache dropped before each
load and before the raw read (``/proc/sys/vm/drop_caches``; as root, otherwise the reads are warm and the
table says so).

Per rank: ``share`` = the bytes of its local tensors; ``peak`` = the process's peak resident memory
(``VmHWM``) minus its resident memory before the model was built (torch, the process group and the
modules ``parallelize_model`` imports are already there: the same layout of tiny-v3 is built first),
so ``peak / share`` is what the load costs beyond the shards it keeps; the target is at most 1.25 plus
the loader's buffer (``PEAK_BUFFER_BYTES``) over the share.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

LAYOUTS = {  # name: (world, overrides)
    "world 1": (1, []),
    "FSDP=2": (2, ["parallel.dp_shard=2"]),
    "FSDP=4": (4, ["parallel.dp_shard=4"]),
    "TP=2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "EP=2 (FSDP=2)": (2, ["parallel.ep=2", "parallel.dp_shard=2"]),
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/bench-hf-load")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--shard-mib", type=int, default=256, help="release shard size")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--train-preset", default="small-v3-sparse", help="model of the training-start part")
    ap.add_argument("--skip-train", action="store_true")
    return ap.parse_args()


def model_config(args):
    from seektrain.models import get_preset

    return get_preset("small-v3-sparse").replace(
        name="bench-v3",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        n_routed_experts=args.experts,
        moe_intermediate_size=args.hidden // 4,
        intermediate_size=3 * args.hidden,
    )


def write_folders(args, root: Path) -> dict[str, Path]:
    """The bf16 release folder, and its FP8 rewrite shard by shard (never the whole model at once)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from seektrain.models import build_model
    from seektrain.models.deepseek.hf_io import save_pretrained
    from seektrain.models.deepseek.hf_weights import fp8_quantization_config, quantize_fp8

    bf16, fp8 = root / "bf16", root / "fp8"
    if not (bf16 / "config.json").exists():
        model = build_model(model_config(args), seed=0)
        save_pretrained(model, bf16, dtype=torch.bfloat16, max_shard_bytes=args.shard_mib * 2**20)
        del model
    if not (fp8 / "config.json").exists():
        fp8.mkdir(parents=True, exist_ok=True)
        index = json.loads((bf16 / "model.safetensors.index.json").read_text())
        names = {}
        for shard in sorted(set(index["weight_map"].values())):
            out = {}
            with safe_open(bf16 / shard, "pt") as fh:
                for key in fh.keys():
                    t = fh.get_tensor(key)
                    if key.startswith("model.layers.") and key.endswith("proj.weight") and t.dim() == 2:
                        out[key], out[key + "_scale_inv"] = quantize_fp8(t)
                    else:
                        out[key] = t
            save_file(out, fp8 / shard, metadata={"format": "pt"})
            names.update(dict.fromkeys(out, shard))
        (fp8 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
        config = json.loads((bf16 / "config.json").read_text())
        config["quantization_config"] = fp8_quantization_config()
        (fp8 / "config.json").write_text(json.dumps(config))
    return {"bf16": bf16, "fp8": fp8}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def raw_read(folder: Path) -> tuple[float, int]:
    """Seconds to read every safetensors file of ``folder`` once, 8 MiB at a time, and the bytes."""
    total, start = 0, time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as fh:
            while chunk := fh.read(8 * 2**20):
                total += len(chunk)
    return time.perf_counter() - start, total


def _status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, from /proc/self/status. Not
    ``ru_maxrss``: that survives ``execve``, so a spawned rank would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _worker(rank: int, world: int, port: int, folder: str, sets: list[str], out: str) -> None:
    import datetime

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    from seektrain.config.loader import load_config
    from seektrain.models import build_model
    from seektrain.models.job_model import configured_model_config
    from seektrain.parallel.mesh import build_meshes
    from seektrain.parallel.parallelize import parallelize_model
    from seektrain.plan.run_plan import RunPlan

    job = load_config(None, [*sets, f"model.hf_path={folder}", "train.micro_batch_size=1"])
    plan = RunPlan.resolve(job, configured_model_config(job), world, "cpu")
    # the same layout on tiny-v3 first: the modules parallelize_model imports and torch's first-use
    # caches are process overhead, not the load's (tiny-v3's ~10 MB may be reused by the load after)
    warm = load_config(None, [*sets, "model.preset=tiny-v3", "train.micro_batch_size=1"])
    warm_plan = RunPlan.resolve(warm, configured_model_config(warm), world, "cpu")
    warm_meshes = build_meshes(warm_plan)
    del parallelize_model(
        build_model(warm_plan.model, device="meta"), warm_plan, warm_meshes, torch.device("cpu")
    ).parts
    meshes = build_meshes(plan)
    dist.barrier()
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    pm = parallelize_model(build_model(plan.model, device="meta"), plan, meshes, torch.device("cpu"), folder)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - before
    share = 0
    for part in pm.parts:
        for tensor in part.state_dict().values():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            share += local.numel() * local.element_size()
    reports = pm.load_reports
    row = {
        "rank": rank,
        "share": share,
        "peak": peak,
        "seconds": seconds,
        "read_seconds": sum(r.seconds for r in reports),
        "bytes_read": sum(r.bytes_read for r in reports),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(row, fh)
    dist.barrier()
    dist.destroy_process_group()


def run_layout(folder: Path, world: int, sets: list[str], out: Path) -> list[dict]:
    import torch.multiprocessing as mp

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        partial(_worker, world=world, port=port, folder=str(folder), sets=sets, out=str(out)),
        nprocs=world,
        start_method="spawn",
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def train_peak(run: Path, sets: list[str]) -> float:
    """Peak resident GiB over the ranks of a 2-step FSDP=2 ``seektrain train`` (metrics.jsonl's
    ``mem_peak_rss_gib``, rank 0's process: the CLI's own numbers)."""
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "seektrain.cli.main", "train", "--nproc-per-node", "2"]
    for item in [
        f"run.dir={run}",
        "train.steps=2",
        "train.seq_len=128",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
        "parallel.dp_shard=2",
        "checkpoint.interval=0",
        "run.progress_bar=false",
        "metrics.tensorboard=false",
        *sets,
    ]:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return max(r.get("mem_peak_rss_gib", 0.0) for r in records)


_PEAK_OF = """
import sys
from pathlib import Path
{body}
for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
        print("VMHWM", int(line.split()[1]) * 1024)
"""
_STREAMED = "from seektrain.cli.main import main\nassert main(sys.argv[1:]) == 0"
_IN_MEMORY = """
from seektrain.checkpoint.export import load_run_checkpoint
from seektrain.models.deepseek.hf_io import save_pretrained
model, _ = load_run_checkpoint(sys.argv[1])
save_pretrained(model, sys.argv[2], max_shard_bytes=256 * 2**20)
"""


def _peak_of(body: str, *argv: str) -> tuple[float, float]:
    """(peak resident bytes, seconds) of a fresh python process running ``body``."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_OF.format(body=body), *argv], check=True, capture_output=True, text=True
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("VMHWM"))
    return float(line.split()[1]), time.perf_counter() - start


def export_peaks(folder: Path, root: Path) -> None:
    """The bf16 folder as a training checkpoint (``convert --to-checkpoint``, fp32), then exported back
    to a release folder: streamed (``convert --from-checkpoint --to-hf``) beside the whole-model way
    (the checkpoint loaded whole, then ``save_pretrained``), peak resident memory of each process."""
    run = root / "export-run"
    if not (run / "checkpoints").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "seektrain.cli.main",
                "convert",
                "--from-hf",
                str(folder),
                "--to-checkpoint",
                str(run),
            ],
            check=True,
            capture_output=True,
        )
    for out in ("export-streamed", "export-in-memory"):
        shutil.rmtree(root / out, ignore_errors=True)
    gib = 2**30
    streamed, t_streamed = _peak_of(
        _STREAMED,
        "convert",
        "--from-checkpoint",
        str(run),
        "--to-hf",
        str(root / "export-streamed"),
        "--max-shard-size",
        "256MB",
    )
    whole, t_whole = _peak_of(_IN_MEMORY, str(run), str(root / "export-in-memory"))
    size = sum(p.stat().st_size for p in (root / "export-streamed").glob("*.safetensors"))
    print(f"\nexport of the fp32 checkpoint ({size / 1e9:.2f} GB of fp32 safetensors written)")
    print("| export | peak resident (GiB) | time (s) |")
    print("|---|---|---|")
    print(f"| streamed (convert --from-checkpoint --to-hf) | {streamed / gib:.2f} | {t_streamed:.1f} |")
    print(f"| whole model in memory, then save_pretrained | {whole / gib:.2f} | {t_whole:.1f} |", flush=True)


def training_start(args, root: Path) -> None:
    """The same 2-step run from a preset's random init and from its Hugging Face folder: LoRA and a
    full fine-tune, FSDP=2; the folder's start must cost at most 10% more peak memory."""
    folder = root / f"{args.train_preset}-hf"
    if not (folder / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "seektrain.cli.main",
                "convert",
                "--preset",
                args.train_preset,
                "--to-hf",
                str(folder),
                "--dtype",
                "bf16",
                "--max-shard-size",
                "100MB",
            ],
            check=True,
            capture_output=True,
        )
    print(f"\ntraining start, {args.train_preset}, FSDP=2, 2 steps (peak resident GiB of rank 0)")
    print("| run | from the preset (random init) | from model.hf_path | ratio |")
    print("|---|---|---|---|")
    for mode, sets in {"LoRA": ["lora.enabled=true"], "full fine-tune": []}.items():
        preset = train_peak(root / "run-preset", [f"model.preset={args.train_preset}", *sets])
        hf = train_peak(root / "run-hf", [f"model.hf_path={folder}", *sets])
        print(f"| {mode} | {preset:.2f} | {hf:.2f} | {hf / preset:.3f} |", flush=True)


def main() -> None:
    args = parse()
    from seektrain.models.hf_slice_reader import PEAK_BUFFER_BYTES

    root = Path(args.dir)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?")
    print(f"CPU: {model}; {os.cpu_count()} cores; torch threads 1 per rank, 4 read threads")
    folders = write_folders(args, root)
    gib = 2**30
    print(f"loader buffer bound (PEAK_BUFFER_BYTES): {PEAK_BUFFER_BYTES / gib:.3f} GiB per rank")
    header = (
        "| folder | layout | ranks | share per rank (GiB) | peak per rank (GiB) | peak / share | bound "
        "| load (s) | raw read of the files (s) | GB read per rank |"
    )
    print(header)
    print("|" + "---|" * 10)
    for kind in args.kinds.split(","):
        folder = folders[kind]
        cold = drop_caches()
        raw_s, raw_bytes = raw_read(folder)
        for name in args.layouts.split(","):
            world, sets = LAYOUTS[name]
            drop_caches()
            rows = run_layout(folder, world, sets, root / "out")
            share = max(r["share"] for r in rows)
            peak = max(r["peak"] for r in rows)
            bound = 1.25 + PEAK_BUFFER_BYTES / share
            print(
                f"| {kind} ({raw_bytes / 1e9:.2f} GB) | {name} | {world} | {share / gib:.2f} | {peak / gib:.2f} "
                f"| {peak / share:.2f} | {bound:.2f} | {max(r['seconds'] for r in rows):.1f} "
                f"| {raw_s:.1f}{'' if cold else ' (warm)'} | {max(r['bytes_read'] for r in rows) / 1e9:.2f} |",
                flush=True,
            )
    export_peaks(folders["bf16"], root)
    if not args.skip_train:
        training_start(args, root)


if __name__ == "__main__":
    sys.exit(main())
