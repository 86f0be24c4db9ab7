"""The one table from dtype names to torch dtypes.

Why one table: config keys (``precision.dtype``, ``precision.reduce_dtype``) use the short names, while
Hugging Face ``config.json`` files and ``seektrain convert --dtype`` also meet the long ones
(``bfloat16``); three copies of this map had started to disagree on which spellings they accept.
"""

from __future__ import annotations

import torch

from seektrain.errors import UserError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LONG_NAMES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_from_name(name: str) -> torch.dtype:
    """``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16`` (any case, ``torch.`` prefix
    allowed) -> the torch dtype; ValueError naming the accepted names otherwise."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = LONG_NAMES.get(key, key)
    if key not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(dtype_names())}")
    return DTYPES[key]


def dtype_names() -> list[str]:
    """Every accepted spelling, short names first."""
    return [*DTYPES, *LONG_NAMES]
