"""Sampling from a trained run: load the newest checkpoint's weights into a plain model and continue
a prompt token by token (no KV cache: this is a check that training worked, not a serving engine)."""

from __future__ import annotations

from pathlib import Path

import torch

from seektrain.models.transformer import Transformer


def load_run_model(run_dir: Path) -> tuple[Transformer, object, Path]:
    """(model with the newest valid checkpoint's weights, its tokenizer, the checkpoint path).
    Only reads the run dir: a training job may be writing into it right now."""
    from seektrain.checkpoint.export import load_checkpoint_model
    from seektrain.checkpoint.finder import resolve_checkpoint
    from seektrain.checkpoint.run_files import checkpoint_model_config, read_run_config
    from seektrain.data.dataset import TokenDataset
    from seektrain.data.tokenizer import load_tokenizer
    from seektrain.train.setup_data import data_dir

    cfg = read_run_config(run_dir)
    path = resolve_checkpoint(run_dir)
    model = load_checkpoint_model(path, checkpoint_model_config(path))
    tokenizer = load_tokenizer(TokenDataset(data_dir(cfg, is_main=True)).manifest.tokenizer.spec)
    return model, tokenizer, path


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    limit = model.cfg.max_position_embeddings
    for _ in range(max_new_tokens):
        logits = model(ids[:, -limit:]).logits[0, -1].float()
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
