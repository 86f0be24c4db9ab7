"""Sampling from a trained run: load the newest checkpoint's weights into a plain model and continue
prompts token by token, through the KV cache (``train/decode.py``; a check that training worked and
evaluation by generation, not a serving engine: one process, no continuous batching).
``seektrain sample`` takes the whole continuation; ``seektrain chat`` streams it as it comes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from seektrain.models import Transformer
from seektrain.train.decode import Decoder

if TYPE_CHECKING:
    from seektrain.data.tokenizer import Tokenizer


def load_run_model(run_dir: Path) -> tuple[Transformer, Tokenizer, Path]:
    """(model with the newest valid checkpoint's weights, its tokenizer, the checkpoint path).
    Only reads the run dir: a training job may be writing into it right now."""
    from seektrain.data.tokenizer import load_tokenizer

    spec = run_tokenizer_spec(run_dir)
    model, path = load_run_weights(run_dir)
    return model, load_tokenizer(spec), path


def load_run_weights(run_dir: Path) -> tuple[Transformer, Path]:
    """(plain model with the newest valid checkpoint's weights, the checkpoint path)."""
    from seektrain.checkpoint.export import load_checkpoint_model
    from seektrain.checkpoint.finder import resolve_checkpoint
    from seektrain.checkpoint.run_files import checkpoint_model_config

    path = resolve_checkpoint(run_dir)
    # load_checkpoint_model builds the registered family's module, typed nn.Module; this module reads it
    # as a Transformer (cfg, forward's ModelOutput), the one family there is
    return cast(Transformer, load_checkpoint_model(path, checkpoint_model_config(path))), path


def run_tokenizer_spec(run_dir: Path) -> str:
    """The tokenizer a run trained with: the copy in its run folder (``tokenizer/``, written at start-up),
    else (a run from before that copy, or the byte tokenizer) the spec its dataset's manifest records."""
    from seektrain.data.tokenizer_files import RUN_TOKENIZER_DIR

    manifest = run_manifest(run_dir)  # first: a folder that is no run dir gets the message that says so
    if (Path(run_dir) / RUN_TOKENIZER_DIR / "tokenizer.json").is_file():
        return str(Path(run_dir) / RUN_TOKENIZER_DIR)
    return manifest.tokenizer.spec


def run_manifest(run_dir: Path):
    """The manifest of the dataset a run trained on."""
    from seektrain.checkpoint.run_files import read_run_config
    from seektrain.data.dataset import TokenDataset
    from seektrain.train.setup_data import data_dir

    return TokenDataset(data_dir(read_run_config(run_dir), is_main=True)).manifest


def stream_tokens(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Iterable[int] = (),
    use_cache: bool = True,
) -> Iterator[int]:
    """Yield sampled token ids one at a time; a stop id is yielded, then the stream ends."""
    for row in stream_batch(
        model, [prompt_ids], max_new_tokens, temperature, top_k, top_p, seed, stop_ids, use_cache
    ):
        token = row[0]
        assert token is not None  # one row: the stream ends when it stops
        yield token


@torch.no_grad()
def stream_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Iterable[int] = (),
    use_cache: bool = True,
) -> Iterator[list[int | None]]:
    """Per step, each prompt's next token id, or None for a row that has ended (its stop id was
    yielded); the stream ends when every row has. Rows share one generator, drawn from in row order,
    so a sampled (not greedy) row depends on the rows before it."""
    gen = torch.Generator().manual_seed(seed)
    stop = set(stop_ids)
    decoder = Decoder(model, prompts, max_new_tokens, use_cache)
    live = [True] * len(prompts)
    picked: torch.Tensor | None = None
    for _ in range(max_new_tokens):
        logits_BV = decoder.first() if picked is None else decoder.step(picked)
        picked = torch.stack([_pick(row, temperature, top_k, top_p, gen) for row in logits_BV])
        yield [int(t) if alive else None for t, alive in zip(picked, live, strict=True)]
        live = [alive and int(t) not in stop for t, alive in zip(picked, live, strict=True)]
        if not any(live):
            return


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator
) -> torch.Tensor:
    """Greedy at temperature 0; else sample among the top_k likeliest tokens, then the smallest set of
    them whose probability reaches top_p (nucleus sampling)."""
    if temperature <= 0:
        return logits.argmax()
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = logits.softmax(-1).sort(descending=True)
        outside = probs.cumsum(-1) - probs >= top_p  # the likeliest token always stays
        logits = logits.index_fill(0, order[outside], float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)[0]


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    use_cache: bool = True,
) -> list[int]:
    return list(
        stream_tokens(model, prompt_ids, max_new_tokens, temperature, top_k, seed=seed, use_cache=use_cache)
    )


def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    stop_ids: Iterable[int] = (),
    use_cache: bool = True,
) -> list[list[int]]:
    """Each prompt's continuation, decoded together (left-padded; ``stream_batch``), up to and
    including its stop id."""
    out: list[list[int]] = [[] for _ in prompts]
    for step in stream_batch(
        model, prompts, max_new_tokens, temperature, top_k, seed=seed, stop_ids=stop_ids, use_cache=use_cache
    ):
        for row, token in zip(out, step, strict=True):
            if token is not None:
                row.append(token)
    return out
