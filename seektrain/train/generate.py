"""Sampling from a trained run: load the newest checkpoint's weights into a plain model and continue
a prompt token by token (no KV cache: this is a check that training worked, not a serving engine)."""

from __future__ import annotations

from pathlib import Path

import torch

from seektrain.checkpoint.manager import CheckpointManager
from seektrain.models.transformer import Transformer


def load_run_model(run_dir: Path) -> tuple[Transformer, object, Path]:
    """(model with the newest valid checkpoint's weights, its tokenizer, the checkpoint path)."""
    from seektrain.checkpoint.export import load_checkpoint_model
    from seektrain.data.dataset import TokenDataset
    from seektrain.data.tokenizer import load_tokenizer
    from seektrain.train.setup_data import data_dir
    from seektrain.train.trainer import read_model_config, read_run_config

    cfg = read_run_config(run_dir)
    path = CheckpointManager(run_dir, keep=1, async_save=False, rank=0).latest_valid()
    if path is None:
        raise ValueError(f"{run_dir}/checkpoints holds no complete checkpoint; train first (seektrain train)")
    model = load_checkpoint_model(path, read_model_config(run_dir))
    tokenizer = load_tokenizer(TokenDataset(data_dir(cfg, is_main=True)).manifest.tokenizer.spec)
    return model, tokenizer, path


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    limit = model.cfg.max_position_embeddings
    for _ in range(max_new_tokens):
        logits = model(ids[:, -limit:])[0, -1].float()
        if temperature <= 0:
            nxt = logits.argmax()
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)[0]
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()
