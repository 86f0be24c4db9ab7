"""Load and save Hugging Face model folders (config.json + safetensors) of the DeepSeek family.

``from_pretrained`` reads the official releases (including DeepSeek-V3's FP8 weights, dequantised on
load, and its MTP layer) and anything transformers 5 writes; ``save_pretrained`` writes the release
layout, which transformers, vLLM and our own loader read back. Weights are read tensor by tensor through
``safe_open`` (memory-mapped, never unpickled) straight into a model built on the meta device and then
materialised, so peak memory stays close to one copy of the model.

Every user error (missing folder/file/tensor, wrong shape, unknown tensor, unsupported config) is a
``ValueError`` subclass with a one-line message naming the file or tensor and what was expected.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seektrain.errors import UserError
from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.hf_config import (
    HFConfigError,
    config_from_hf,
    config_to_hf,
    quant_block_size,
    read_config_json,
)
from seektrain.models.deepseek.hf_weights import (
    FP8_DTYPES,
    Entry,
    dequantize_fp8,
    dtype_name,
    fused_alternatives,
    hf_layout,
    is_ignored,
    part_shape,
    part_view,
    scale_shape,
    shard_plan,
)
from seektrain.models.deepseek.transformer import Transformer, build_model
from seektrain.models.hub import resolve_local_path
from seektrain.models.kernels import Kernels

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # what the official releases and transformers use
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_FP8_NAMES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class HFWeightsError(UserError):
    """The weights of a model folder do not match its config.json; one line naming file and tensor."""


# ------------------------------------------------------------------------------------------ reading
def _weight_map(path: str) -> dict[str, str]:
    """Tensor name -> shard file name, from the index json or the single ``model.safetensors``."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            RecursionError,
        ) as exc:
            raise HFWeightsError(
                f"{index}: unreadable index ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        for key, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard or not shard:
                raise HFWeightsError(
                    f"{index}: weight_map[{key!r}] = {shard!r} is not a file name of this folder"
                )
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise HFWeightsError(f"{os.path.join(path, shard)}: missing shard (listed in {INDEX_FILE})")
            with _open(os.path.join(path, shard)) as fh:  # header only: which tensors the shard holds
                held = set(fh.keys())
            for key in sorted(k for k, s in weight_map.items() if s == shard and k not in held):
                raise HFWeightsError(
                    f"{index}: weight_map puts {key} in {shard}, which does not hold it; fix "
                    "the index (or re-download the model)"
                )
        return weight_map
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with _open(single) as fh:
            return dict.fromkeys(fh.keys(), SINGLE_FILE)
    if any(name.endswith(".bin") for name in os.listdir(path)):
        raise HFWeightsError(
            f"{path}: only pickle .bin weights found; convert them to safetensors first "
            "(we never unpickle checkpoints)"
        )
    raise HFWeightsError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise HFWeightsError(f"{file}: not a readable safetensors file ({exc})") from None


def _present_mtp_layers(cfg, keys) -> int:
    """How many MTP layers the files actually hold (transformers 5 saves V3 without them)."""
    n = 0
    while n < cfg.num_nextn_predict_layers:
        prefix = f"model.layers.{cfg.num_hidden_layers + n}."
        if not any(key.startswith(prefix) for key in keys):
            break
        n += 1
    return n


def _plan(cfg, shapes: dict, weight_map: dict[str, str], path: str) -> list[tuple[str, Entry]]:
    """Match every tensor in the folder to our parameters; fail on unknown or missing ones."""
    entries = hf_layout(cfg, shapes)
    expected = {e.hf_key: e for e in entries}
    fused = fused_alternatives(entries)
    plan, whole, parts = [], set(), set()
    for key in sorted(weight_map):
        if key in expected:
            entry = expected[key]
        elif key in fused:
            entry = Entry(key, fused[key])
        elif is_ignored(key) or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        elif key.endswith("_scale_inv") and key[: -len("_scale_inv")] in weight_map:
            continue  # read together with its weight
        else:
            raise HFWeightsError(
                f"{key}: unexpected tensor in {weight_map[key]} (a {cfg.arch} model with this "
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


def _check_shapes(plan, shapes, weight_map, handles, block) -> None:
    """Header-only pass so a wrong shape fails before hours of reading, not after."""
    for key, entry in plan:
        file = weight_map[key]
        tslice = handles(file).get_slice(key)
        got, want = tuple(tslice.get_shape()), part_shape(shapes[entry.ours], entry.part)
        if got != want:
            raise HFWeightsError(f"{key}: expected shape {want}, got {got} in {file}")
        if tslice.get_dtype() in _FP8_NAMES:
            scale_key = key + "_scale_inv"
            if scale_key not in weight_map:
                raise HFWeightsError(f"{scale_key}: missing tensor (the FP8 weight {key} in {file} needs it)")
            s_got = tuple(handles(weight_map[scale_key]).get_slice(scale_key).get_shape())
            if len(got) != 2 or s_got != scale_shape(got, block):
                want_s = scale_shape(got, block) if len(got) == 2 else "a 2-D weight"
                raise HFWeightsError(
                    f"{scale_key}: expected shape {want_s}, got {s_got} in {weight_map[scale_key]}"
                )


def _open_pretrained(spec: str, what: str) -> tuple[str, dict, ModelConfig, dict]:
    """(local folder, raw config.json, the model config its weights hold, weight map) of a Hugging Face
    folder or cached hub id; reads headers only, no tensors."""
    path = os.fspath(resolve_local_path(spec, what))
    raw = read_config_json(path, what)
    from_hub = os.path.normpath(path) != os.path.normpath(os.path.expanduser(spec))
    name = spec.rsplit("/", 1)[-1] if from_hub else os.path.basename(os.path.normpath(path))
    cfg = config_from_hf(raw, name=name or "custom", where=os.path.join(path, "config.json"))
    weight_map = _weight_map(path)
    present = _present_mtp_layers(cfg, weight_map)
    if present < cfg.num_nextn_predict_layers:
        log.warning(
            "%s: config.json asks for %d MTP layer(s) but the weights hold %d; building the model with %d",
            path,
            cfg.num_nextn_predict_layers,
            present,
            present,
        )
        cfg = cfg.replace(num_nextn_predict_layers=present)
    return path, raw, cfg, weight_map


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
    ``kernels`` as for ``build_model``."""
    path, raw, cfg, weight_map = _open_pretrained(os.fspath(path), what)
    block = quant_block_size(raw)
    model = build_model(cfg, device="meta", dtype=dtype, init=False, kernels=kernels)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    plan = _plan(cfg, shapes, weight_map, path)

    with contextlib.ExitStack() as stack:
        opened: dict[str, object] = {}

        def handles(file: str):
            if file not in opened:
                opened[file] = stack.enter_context(_open(os.path.join(path, file)))
            return opened[file]

        _check_shapes(plan, shapes, weight_map, handles, block)
        model.to_empty(device=device)
        if cfg.tie_word_embeddings:  # to_empty re-creates parameters one module at a time: re-tie
            model.lm_head.weight = model.embed_tokens.weight
        targets: dict[str, torch.Tensor] = dict(model.named_parameters())
        targets.update(model.named_buffers())
        with torch.no_grad():
            for key, entry in sorted(plan, key=lambda item: (weight_map[item[0]], item[0])):
                tensor = handles(weight_map[key]).get_tensor(key)
                target = part_view(targets[entry.ours], entry.part)
                if tensor.dtype in FP8_DTYPES:
                    scale_key = key + "_scale_inv"
                    scale = handles(weight_map[scale_key]).get_tensor(scale_key)
                    tensor = dequantize_fp8(tensor, scale, block, target.dtype)
                target.copy_(tensor)
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
