"""Deterministic, layout-independent weight initialisation.

Every parameter's random values are a function of (seed, parameter name, row block) only, so a model
initialised whole on one process, or sharded by FSDP / split by tensor or pipeline parallelism and
initialised in pieces on many, holds exactly the same weights. That is what makes single-process and
multi-process runs comparable loss for loss, and lets huge models initialise shard by shard without
ever materialising a full tensor.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

_BLOCK_ELEMS = 1 << 22  # values generated per random block (~16 MB of fp32)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def canonical_name(name: str) -> str:
    """Parameter name without the prefixes that wrappers (checkpointing, compile, DDP) insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _seed_for(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _local_view(
    param: torch.Tensor,
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, local shape, global offset) for a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return local, tuple(param.shape), tuple(shape), tuple(offset)
    return param, tuple(param.shape), tuple(param.shape), (0,) * param.ndim


@torch.no_grad()
def deterministic_normal_(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    def sample(shape, gen):
        return torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32).mul_(std)

    _deterministic_fill_(param, seed, name, sample)


@torch.no_grad()
def deterministic_uniform_(param: torch.Tensor, bound: float, seed: int, name: str) -> None:
    """Uniform(-bound, bound), layout-independent like ``deterministic_normal_``."""

    def sample(shape, gen):
        values = torch.empty(shape, device=gen.device, dtype=torch.float32)
        return values.uniform_(-bound, bound, generator=gen)

    _deterministic_fill_(param, seed, name, sample)


def _deterministic_fill_(param: torch.Tensor, seed: int, name: str, sample) -> None:
    """Fill ``param``'s local part from ``sample(block shape, generator)`` (fp32), one generator per
    (seed, name, row block)."""
    local, gshape, lshape, offset = _local_view(param)
    if local.numel() == 0:
        return
    row_elems = math.prod(gshape[1:]) if len(gshape) > 1 else 1
    rows_per_block = max(1, _BLOCK_ELEMS // row_elems)
    r0, r1 = offset[0], offset[0] + lshape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], lshape[1:]))
    for block in range(r0 // rows_per_block, (r1 - 1) // rows_per_block + 1):
        b0 = block * rows_per_block
        b1 = min(b0 + rows_per_block, gshape[0])
        gen = torch.Generator(device=local.device).manual_seed(_seed_for(seed, name, block))
        values = sample((b1 - b0,) + gshape[1:], gen)
        lo, hi = max(b0, r0), min(b1, r1)
        local[lo - r0 : hi - r0].copy_(values[(slice(lo - b0, hi - b0),) + inner])


def init_adapter_(param: torch.Tensor, seed: int, name: str) -> None:
    """A LoRA adapter (models/lora.py) as PEFT starts it: A kaiming-uniform with a=sqrt(5), i.e.
    Uniform(±1/sqrt(fan_in)) with fan_in its last dimension (per expert for ``[E, r, in]``); B zeros,
    so the adapted model starts as the base."""
    if "lora_B" in name:
        _local_view(param)[0].zero_()
    else:
        deterministic_uniform_(param, 1.0 / math.sqrt(param.shape[-1]), seed, name)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialise only the adapters (the base came from a Hugging Face folder)."""
    from seektrain.models.lora import is_adapter

    for name, param in model.named_parameters():
        if is_adapter(name):
            init_adapter_(param, seed, canonical_name(name))


@torch.no_grad()
def init_weights(model: nn.Module, std: float, seed: int) -> None:
    """Normal(0, std) for matrices and embeddings, ones for norm scales, zeros for biases and buffers
    of the balancing bias, LoRA adapters as ``init_adapter_``. Works on plain, FSDP-sharded and
    tensor-parallel parameters alike."""
    from seektrain.models.deepseek.moe import Router
    from seektrain.models.layers import RMSNorm
    from seektrain.models.lora import is_adapter

    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            full = canonical_name(f"{mod_name}.{p_name}" if mod_name else p_name)
            local = _local_view(param)[0]
            if is_adapter(p_name):
                init_adapter_(param, seed, full)
            elif isinstance(module, RMSNorm):
                local.fill_(1.0)
            elif p_name == "bias":
                local.zero_()
            else:
                deterministic_normal_(param, std, seed, full)
        if isinstance(module, Router) and module.e_score_correction_bias is not None:
            _local_view(module.e_score_correction_bias)[0].zero_()
