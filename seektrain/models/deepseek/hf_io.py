"""Load and save Hugging Face model folders (config.json + safetensors) of the DeepSeek family.

``from_pretrained`` reads the official releases (including DeepSeek-V3's FP8 weights, dequantised on
load, and its MTP layer) and anything transformers 5 writes; ``save_pretrained`` writes the release
layout, which transformers, vLLM and our own loader read back. ``load_hf_weights`` fills a sharded
model (or a pipeline stage of one), each rank reading only the slices it holds
(``hf_folder.py`` maps our tensors onto the stored ones, ``checkpoint/hf_shard_load.py`` reads them:
``pread``, never unpickled, never memory-mapped); ``from_pretrained`` is the same read of a whole model.

Every user error (missing folder/file/tensor, wrong shape, unknown tensor, unsupported config) is a
``ValueError`` subclass with a one-line message naming the file or tensor and what was expected.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors.torch import save_file
from torch import nn

from seektrain.checkpoint.hf_shard_load import DEFAULT_THREADS, LoadReport, load_local_shards
from seektrain.checkpoint.safetensors_slices import HFWeightsError
from seektrain.errors import UserError
from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.hf_config import HFConfigError, config_from_hf, config_to_hf, read_config_json
from seektrain.models.deepseek.hf_folder import INDEX_FILE, SINGLE_FILE, HFFolder, open_folder
from seektrain.models.deepseek.hf_weights import (
    FP8_DTYPES,
    Entry,
    dtype_name,
    hf_layout,
    part_shape,
    part_view,
    shard_plan,
)
from seektrain.models.deepseek.transformer import Transformer, build_model
from seektrain.models.hub import resolve_local_path
from seektrain.models.kernels import Kernels

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # what the official releases and transformers use
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_FP8_NAMES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


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
    model = build_model(opened.cfg, device="meta", dtype=dtype, init=False, kernels=kernels)
    folder = HFFolder(opened, {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()})
    model.to_empty(device=device)
    if opened.cfg.tie_word_embeddings:  # to_empty re-creates parameters one module at a time: re-tie
        model.lm_head.weight = model.embed_tokens.weight
    report = load_local_shards(model, folder)
    if report.not_loaded:
        raise HFWeightsError(f"{folder.path}: holds no tensor for {report.not_loaded[0]}")
    return model


def load_hf_weights(
    module: nn.Module, path: str | os.PathLike, what: str = "model.hf_path", threads: int = DEFAULT_THREADS
) -> LoadReport:
    """Fill the local tensors of ``module`` (this family's model or a pipeline stage of it, materialised
    and possibly sharded) from the folder ``path``, each rank reading only its own slices, in the
    dtypes the module holds; ``report.not_loaded`` names the tensors the folder does not have (LoRA
    adapters). The folder's config must describe ``module.cfg``'s shapes."""
    opened = open_folder(os.fspath(path), what)
    full = build_model(module.cfg, device="meta", init=False)  # the shapes of the whole model
    folder = HFFolder(opened, {name: tuple(t.shape) for name, t in full.state_dict(keep_vars=True).items()})
    return load_local_shards(module, folder, threads=threads)


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
    stale shard can never be mixed in.
    """
    path = os.fspath(path)
    cfg = model.cfg
    state = model.state_dict()
    out_dtype = dtype or state["embed_tokens.weight"].dtype
    if out_dtype in FP8_DTYPES:
        raise UserError("saving FP8 weights is not supported; choose bf16, fp16 or fp32")

    def cast(entry: Entry) -> torch.dtype:
        return torch.float32 if entry.ours.endswith("e_score_correction_bias") else out_dtype

    entries = hf_layout(cfg, {name: tuple(t.shape) for name, t in state.items()})
    sizes = []
    for entry in entries:
        numel = 1
        for dim in part_shape(tuple(state[entry.ours].shape), entry.part):
            numel *= dim
        sizes.append(numel * torch.empty((), dtype=cast(entry)).element_size())
    ranges = shard_plan(sizes, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(ranges) == 1
        else [f"model-{i + 1:05d}-of-{len(ranges):05d}.safetensors" for i in range(len(ranges))]
    )

    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):
        if _SHARD_NAME.match(old) or old == INDEX_FILE:
            os.remove(os.path.join(path, old))
    weight_map = {}
    for name, (start, end) in zip(names, ranges):
        tensors = {}
        for entry in entries[start:end]:
            # copy=True: per-expert slices share storage, and safetensors refuses shared tensors
            tensors[entry.hf_key] = (
                part_view(state[entry.ours], entry.part)
                .detach()
                .to(device="cpu", dtype=cast(entry), copy=True)
                .contiguous()
            )
            weight_map[entry.hf_key] = name
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        del tensors
    if len(names) > 1:
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config_to_hf(cfg, dtype_name(out_dtype)), fh, indent=2)
        fh.write("\n")
    return names


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFConfigError", "HFWeightsError", "from_pretrained", "save_pretrained"]
