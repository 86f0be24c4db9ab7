"""Load and save Hugging Face model folders (config.json + safetensors) of the DeepSeek family.

``from_pretrained`` reads the official releases (including DeepSeek-V3's FP8 weights, dequantised on
load, and its MTP layer) and anything transformers 5 writes; ``save_pretrained`` writes the release
layout, which transformers, vLLM and our own loader read back. ``load_hf_weights`` fills a sharded
model (or a pipeline stage of one), each rank reading only the slices it holds
(``hf_folder.py`` maps our tensors onto the stored ones, ``models/hf_slice_reader.py`` reads them:
``pread``, never unpickled, never memory-mapped); ``from_pretrained`` is the same read of a whole model.

Every user error (missing folder/file/tensor, wrong shape, unknown tensor, unsupported config) is a
``ValueError`` subclass with a one-line message naming the file or tensor and what was expected.
"""

from __future__ import annotations

import logging
import os

import torch

from seektrain.models.config import ModelConfig
from seektrain.models.construct import construct_model
from seektrain.models.deepseek.hf_config import HFConfigError, config_from_hf, read_config_json
from seektrain.models.deepseek.hf_export import DEFAULT_MAX_SHARD_BYTES, export_release
from seektrain.models.deepseek.hf_folder import HFFolder, open_folder
from seektrain.models.deepseek.transformer import Transformer, keep_fp32_buffers
from seektrain.models.hf_slice_reader import (
    DEFAULT_THREADS,
    LoadReport,
    LocalShard,
    fill_shards,
    whole_shards,
)
from seektrain.models.hub import resolve_local_path
from seektrain.models.kernels import Kernels
from seektrain.models.safetensors_slices import HFWeightsError

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ reading
def _open_pretrained(spec: str, what: str) -> tuple[str, dict, ModelConfig, dict]:
    """(local folder, raw config.json, the model config its weights hold, weight map): headers only."""
    opened = open_folder(spec, what)
    return opened.path, opened.raw, opened.cfg, opened.names


def pretrained_config(path: str | os.PathLike, what: str = "model.hf_path") -> ModelConfig:
    """The model config ``from_pretrained(path)`` builds, without reading any weights (the run plan needs
    it before the weights are loaded)."""
    return _open_pretrained(os.fspath(path), what)[2]


def declared_config(path: str | os.PathLike, what: str = "model.hf_path") -> ModelConfig:
    """The model config.json declares, weights not consulted: what ``seektrain plan`` needs, so a folder
    holding only config.json (before 1.3 TB of weights are downloaded) can be planned."""
    local = os.fspath(resolve_local_path(os.fspath(path), what))
    name = os.path.basename(os.path.normpath(local)) or "custom"
    return config_from_hf(read_config_json(local, what), name=name, where=os.path.join(local, "config.json"))


def from_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    what: str = "model.hf_path",
    kernels: Kernels | None = None,
) -> Transformer:
    """Build our ``Transformer`` from a Hugging Face folder (config.json + safetensors, sharded or not),
    or from a hub id (``org/name``) already in the local Hugging Face cache (``seektrain.models.hub``);
    ``kernels`` as for ``build_model``. The same slice-by-slice read as a sharded load, of all of it."""
    opened = open_folder(os.fspath(path), what)
    model = _meta_model(opened.cfg, dtype, kernels)
    folder = HFFolder(opened, {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()})
    model.to_empty(device=device)
    if opened.cfg.tie_word_embeddings:  # to_empty re-creates parameters one module at a time: re-tie
        model.lm_head.weight = model.embed_tokens.weight
    report = fill_shards(whole_shards(model), folder)
    if report.not_loaded:
        raise HFWeightsError(f"{folder.path}: holds no tensor for {report.not_loaded[0]}")
    return model


def load_hf_weights(
    shards: list[LocalShard],
    cfg: ModelConfig,
    path: str | os.PathLike,
    what: str = "model.hf_path",
    threads: int = DEFAULT_THREADS,
) -> LoadReport:
    """Fill ``shards`` (a materialised model's or pipeline stage's local tensors, each the box of the
    full tensor this rank holds) from the folder ``path``, reading only those slices, into the shards'
    dtypes; ``report.not_loaded`` names the tensors the folder does not have (LoRA adapters). The
    folder must hold the model of ``cfg``."""
    return fill_shards(shards, open_hf_source(path, cfg, what), threads=threads)


def open_hf_source(path: str | os.PathLike, cfg: ModelConfig, what: str = "model.hf_path") -> HFFolder:
    """The folder ``path`` matched to the whole model of ``cfg`` (headers checked, nothing read yet):
    the source of slice reads for any box of any of its tensors."""
    full = _meta_model(cfg)
    shapes = {name: tuple(t.shape) for name, t in full.state_dict(keep_vars=True).items()}
    return HFFolder(open_folder(os.fspath(path), what), shapes)


def _meta_model(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, kernels: Kernels | None = None
) -> Transformer:
    model = construct_model(Transformer, keep_fp32_buffers, cfg, "meta", dtype, init=False, kernels=kernels)
    assert isinstance(model, Transformer)
    return model


# ------------------------------------------------------------------------------------------ writing
def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``model`` as a Hugging Face folder in the release layout; returns the weight files written.

    ``dtype`` casts the weights (default: the embedding's dtype); the MoE balancing bias always stays
    fp32. Above ``max_shard_bytes`` the weights are split into ``model-0000k-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``. Weight files of an earlier save in ``path`` are removed first so a
    stale shard can never be mixed in (``hf_export.export_release``, which writes piece by piece).
    """
    state = model.state_dict()

    def read(requests):
        return [state[name][tuple(slice(lo, hi) for lo, hi in box)].detach().cpu() for name, box in requests]

    shapes = {name: tuple(t.shape) for name, t in state.items()}
    out_dtype = dtype or state["embed_tokens.weight"].dtype
    return export_release(model.cfg, shapes, read, path, out_dtype, max_shard_bytes)


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFConfigError", "HFWeightsError", "from_pretrained", "save_pretrained"]
