"""A Hugging Face folder of the DeepSeek family opened for reading: its config, which file holds which
tensor, every tensor matched to our parameters and checked against the model's shapes (headers only,
before any weight is read), and the slice reads that fill any box of any of our tensors.

``reads`` is the family's half of the rank-sharded load (``models/hf_slice_reader.py`` does the
reading): a box of our tensor maps onto the stored tensors that hold it. Most map one to one; a fused
expert tensor ``[E, 2I, H]`` is stored as one ``gate_proj`` and one ``up_proj`` ``[I, H]`` per expert
(``down_proj`` ``[H, I]``), so an expert-parallel or FSDP box over experts reads its own experts only, and
a tensor-parallel box over ``I`` reads the matching rows of each gate and up part.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.hf_config import config_from_hf, quant_block_size, read_config_json
from seektrain.models.deepseek.hf_weights import (
    FP8_DTYPES,
    Entry,
    fused_alternatives,
    hf_layout,
    is_ignored,
    part_region,
    part_shape,
    scale_shape,
)
from seektrain.models.hf_slice_reader import LocalShard, SliceRead
from seektrain.models.hub import resolve_local_path
from seektrain.models.safetensors_slices import HFWeightsError, TensorInfo, read_header

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_map(path: str) -> tuple[dict[str, str], dict[str, dict[str, TensorInfo]]]:
    """(tensor name -> file name, file name -> its header), from the index json or the single
    ``model.safetensors``; every file listed is opened (its header only) and must hold what is listed."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        names = _read_index(index)
        headers = {}
        for shard in sorted(set(names.values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise HFWeightsError(f"{os.path.join(path, shard)}: missing shard (listed in {INDEX_FILE})")
            headers[shard] = read_header(os.path.join(path, shard))
            for key in sorted(k for k, s in names.items() if s == shard and k not in headers[shard]):
                raise HFWeightsError(
                    f"{index}: weight_map puts {key} in {shard}, which does not hold it; fix "
                    "the index (or re-download the model)"
                )
        return names, headers
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        header = read_header(single)
        return dict.fromkeys(header, SINGLE_FILE), {SINGLE_FILE: header}
    if any(name.endswith(".bin") for name in os.listdir(path)):
        raise HFWeightsError(
            f"{path}: only pickle .bin weights found; convert them to safetensors first "
            "(we never unpickle checkpoints)"
        )
    raise HFWeightsError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _read_index(index: str) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as fh:
            names = json.load(fh)["weight_map"]
        if not isinstance(names, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as exc:
        raise HFWeightsError(f"{index}: unreadable index ({type(exc).__name__}: {str(exc)[:200]})") from None
    for key, shard in names.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or not shard:
            raise HFWeightsError(
                f"{index}: weight_map[{key!r}] = {shard!r} is not a file name of this folder"
            )
    return names


def _present_mtp_layers(cfg: ModelConfig, keys) -> int:
    """How many MTP layers the files actually hold (transformers 5 saves V3 without them)."""
    n = 0
    while n < cfg.num_nextn_predict_layers:
        prefix = f"model.layers.{cfg.num_hidden_layers + n}."
        if not any(key.startswith(prefix) for key in keys):
            break
        n += 1
    return n


@dataclass(frozen=True)
class OpenedFolder:
    """What ``open_folder`` finds without reading weights."""

    path: str
    raw: dict  # config.json
    cfg: ModelConfig  # the model its weights hold
    names: dict[str, str]  # tensor -> file
    headers: dict[str, dict[str, TensorInfo]]  # file -> header


def open_folder(spec: str, what: str) -> OpenedFolder:
    """A Hugging Face folder or cached hub id, its config and headers read, no tensors."""
    path = os.fspath(resolve_local_path(spec, what))
    raw = read_config_json(path, what)
    from_hub = os.path.normpath(path) != os.path.normpath(os.path.expanduser(spec))
    name = spec.rsplit("/", 1)[-1] if from_hub else os.path.basename(os.path.normpath(path))
    cfg = config_from_hf(raw, name=name or "custom", where=os.path.join(path, "config.json"))
    names, headers = weight_map(path)
    present = _present_mtp_layers(cfg, names)
    if present < cfg.num_nextn_predict_layers:
        log.warning(
            "%s: config.json asks for %d MTP layer(s) but the weights hold %d; building the model with %d",
            path,
            cfg.num_nextn_predict_layers,
            present,
            present,
        )
        cfg = cfg.replace(num_nextn_predict_layers=present)
    return OpenedFolder(path, raw, cfg, names, headers)


class HFFolder:
    """The tensors of an opened folder matched to a model whose full state-dict shapes are ``shapes``
    (every tensor the folder holds is known, every one the model needs is there, with its shape)."""

    def __init__(self, opened: OpenedFolder, shapes: dict[str, tuple[int, ...]]):
        self.path = opened.path
        self.block = quant_block_size(opened.raw)
        self._names = opened.names
        self._headers = opened.headers
        self._shapes = shapes
        self._by_ours: dict[str, list[Entry]] = {}
        for key, entry in _match(opened.cfg, shapes, opened.names, opened.path):
            self._check(key, entry)
            self._by_ours.setdefault(entry.ours, []).append(entry)

    def info(self, file: str, key: str) -> TensorInfo:
        return self._headers[file][key]

    def _check(self, key: str, entry: Entry) -> None:
        """Shape (and, for FP8, the scale's shape): a wrong shape fails before hours of reading."""
        file = self._names[key]
        info = self.info(file, key)
        want = part_shape(self._shapes[entry.ours], entry.part)
        if info.shape != want:
            raise HFWeightsError(f"{key}: expected shape {want}, got {info.shape} in {file}")
        if info.dtype in FP8_DTYPES:
            scale_key = key + "_scale_inv"
            if scale_key not in self._names:
                raise HFWeightsError(f"{scale_key}: missing tensor (the FP8 weight {key} in {file} needs it)")
            got = self.info(self._names[scale_key], scale_key).shape
            if len(want) != 2 or got != scale_shape(want, self.block):
                want_s = scale_shape(want, self.block) if len(want) == 2 else "a 2-D weight"
                raise HFWeightsError(
                    f"{scale_key}: expected shape {want_s}, got {got} in {self._names[scale_key]}"
                )
        elif info.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise HFWeightsError(f"{key}: dtype {info.dtype} in {file} is not a floating-point weight")

    def reads(self, shard: LocalShard) -> list[SliceRead] | None:
        entries = self._by_ours.get(shard.name)
        if entries is None:
            return None
        out = []
        for entry in entries:
            region, stored_dims = part_region(shard.full_shape, entry.part)
            lo = [max(a, r) for (a, _), (r, _) in zip(shard.box, region)]
            hi = [min(b, r) for (_, b), (_, r) in zip(shard.box, region)]
            if any(low >= high for low, high in zip(lo, hi)):
                continue
            box = tuple((lo[d] - region[d][0], hi[d] - region[d][0]) for d in stored_dims)
            dest = tuple((lo[d] - a, hi[d] - a) for d, (a, _) in enumerate(shard.box))
            file = self._names[entry.hf_key]
            scale = None
            if self.info(file, entry.hf_key).dtype in FP8_DTYPES:
                scale_key = entry.hf_key + "_scale_inv"
                scale = (self._names[scale_key], scale_key)
            out.append(SliceRead(file, entry.hf_key, box, dest, scale))
        return out


def _match(cfg: ModelConfig, shapes: dict, names: dict[str, str], path: str) -> list[tuple[str, Entry]]:
    """Match every tensor in the folder to our parameters; fail on unknown or missing ones."""
    entries = hf_layout(cfg, shapes)
    expected = {e.hf_key: e for e in entries}
    fused = fused_alternatives(entries)
    plan, whole, parts = [], set(), set()
    for key in sorted(names):
        if key in expected:
            entry = expected[key]
        elif key in fused:
            entry = Entry(key, fused[key])
        elif is_ignored(key) or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        elif key.endswith("_scale_inv") and key[: -len("_scale_inv")] in names:
            continue  # read together with its weight
        else:
            raise HFWeightsError(
                f"{key}: unexpected tensor in {names[key]} (a {cfg.arch} model with this "
                f"config.json has no such weight)"
            )
        if entry.copy:
            continue
        if entry.part is None:
            whole.add(entry.ours)
        else:
            parts.add((entry.ours, entry.part))
        plan.append((key, entry))
    for entry in entries:
        if entry.copy or entry.ours in whole or (entry.ours, entry.part) in parts:
            continue
        shape = part_shape(shapes[entry.ours], entry.part)
        raise HFWeightsError(f"{entry.hf_key}: missing tensor (expected shape {shape}) in {path}")
    clash = whole & {ours for ours, _ in parts}
    if clash:
        raise HFWeightsError(f"{path}: both fused and per-expert tensors given for {sorted(clash)[0]}")
    return plan
