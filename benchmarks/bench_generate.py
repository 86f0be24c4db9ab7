"""What the KV cache buys generation: tokens/s of greedy decoding with and without it, side by side.

One process, one model, one prompt; for each number of new tokens, ``generate`` with the cache (the
prompt run once, then one token per step) and without it (each step reruns the whole sequence), timed
back to back, and the two continuations checked equal. Without the cache a step costs the whole
sequence so far, so the ratio grows with the number of tokens; the issue's bar is 5x at 1024.

    python benchmarks/bench_generate.py                     # tiny-v3, 64/256/1024 new tokens
    python benchmarks/bench_generate.py --preset tiny-dense --tokens 64 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_auto_dtype import cpu_name
from bench_model_vs_hf import load_avg
from seektrain.models import build_model, get_preset
from seektrain.train.generate import generate


def timed(model, prompt: list[int], new: int, use_cache: bool) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = generate(model, prompt, new, temperature=0, use_cache=use_cache)
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-v3")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024], help="new tokens per run")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    cfg = get_preset(args.preset).replace(num_nextn_predict_layers=0)  # MTP is not used in generation
    model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(
        f"model {args.preset}, fp32, greedy, prompt {args.prompt_len} tokens; load avg at start {load_avg()}"
    )
    generate(model, prompt.tolist(), 8, temperature=0)  # warm-up
    print("| new tokens | with cache (tok/s) | without cache (tok/s) | speed-up | same tokens |")
    print("|---:|---:|---:|---:|:---:|")
    for new in args.tokens:
        cached, t_cached = timed(model, prompt.tolist(), new, use_cache=True)
        plain, t_plain = timed(model, prompt.tolist(), new, use_cache=False)
        print(
            f"| {new} | {new / t_cached:.1f} | {new / t_plain:.1f} | {t_plain / t_cached:.1f}x | "
            f"{'yes' if cached == plain else 'NO'} |",
            flush=True,
        )
    print(f"load avg at end {load_avg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
