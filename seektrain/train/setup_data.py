"""The training data of a run: a prepared folder or the built-in corpus, opened for this rank, with its
batches agreed undamaged by every rank (``seektrain/data/agreed.py``) and read ahead (``data.prefetch``,
``seektrain/data/prefetch.py``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.config.schema import JobConfig
from seektrain.data.agreed import agreed
from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.builtin import ensure_builtin_corpus
from seektrain.data.dataset import TokenDataset
from seektrain.data.prefetch import PrefetchingLoader
from seektrain.errors import UserError
from seektrain.models.config import ModelConfig

log = logging.getLogger("seektrain.train")


@dataclass
class TrainingData:
    path: Path
    dataset: TokenDataset
    loader: DistributedBatchLoader
    batches: PrefetchingLoader  # what the step reads, and whose position a checkpoint holds

    def describe(self) -> str:
        checked = "" if self.dataset.block_checked else ", no block checksums"
        return f"data {self.path} ({len(self.dataset):,} tokens{checked})"

    def close(self) -> None:
        self.batches.close()


def data_dir(cfg: JobConfig, is_main: bool) -> Path:
    """The prepared folder; the built-in corpus is prepared by rank 0 first (others then reuse it)."""
    if cfg.data.path != "builtin":
        return Path(cfg.data.path)
    if is_main:
        path = ensure_builtin_corpus(tokenizer_spec=cfg.data.tokenizer)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if not is_main:
        path = ensure_builtin_corpus(tokenizer_spec=cfg.data.tokenizer)
    return path


def open_training_data(
    cfg: JobConfig,
    model_cfg: ModelConfig,
    dp_rank: int,
    dp_size: int,
    is_main: bool,
    pin_device: torch.device | None = None,
) -> TrainingData:
    """``pin_device``: the accelerator the batches go to, when they should be pinned in host memory."""
    path = data_dir(cfg, is_main)
    dataset = TokenDataset(path, split="train")
    if dataset.vocab_size > model_cfg.vocab_size:
        raise UserError(
            f"data.path={path}: its tokenizer has {dataset.vocab_size} tokens but model "
            f"{model_cfg.name} has vocab_size {model_cfg.vocab_size}; use a matching tokenizer"
        )
    if is_main and not dataset.block_checked:
        log.warning(
            "data.path=%s has no block checksums (prepared by an older seektrain): a shard that changes "
            "during the run is not noticed; re-run `seektrain data prepare ... --force` to add them",
            path,
        )
    loader = DistributedBatchLoader(
        dataset,
        cfg.train.seq_len,
        cfg.train.micro_batch_size,
        dp_rank,
        dp_size,
        cfg.train.seed,
        cfg.data.packing,
        cfg.data.document_mask,
    )
    batches = PrefetchingLoader(agreed(loader, cfg.dist.collective_timeout_s), cfg.data.prefetch, pin_device)
    return TrainingData(path, dataset, loader, batches)
