"""Data pipeline: tokenizers, ``data prepare`` shards + manifest, the built-in corpus, and the loader.

``DistributedBatchLoader`` is imported lazily so that ``seektrain data ...`` does not pay for torch.
"""

from typing import Any

from seektrain.data.builtin import builtin_corpus_dir, ensure_builtin_corpus
from seektrain.data.dataset import TokenDataset, verify_dataset
from seektrain.data.manifest import Manifest, read_manifest
from seektrain.data.prepare import prepare_dataset
from seektrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DistributedBatchLoader",
    "HFTokenizer",
    "Manifest",
    "TokenDataset",
    "Tokenizer",
    "builtin_corpus_dir",
    "ensure_builtin_corpus",
    "load_tokenizer",
    "prepare_dataset",
    "read_manifest",
    "verify_dataset",
]


def __getattr__(name: str) -> Any:
    if name == "DistributedBatchLoader":
        from seektrain.data.batch_loader import DistributedBatchLoader

        return DistributedBatchLoader
    raise AttributeError(f"module 'seektrain.data' has no attribute {name!r}")
