"""Rows of a Hugging Face ``datasets`` folder (``Dataset.save_to_disk``), read with pyarrow alone.

Such a folder is Arrow IPC stream files (``data-00000-of-00001.arrow``...) listed, in order, by
``state.json``'s ``_data_files``, next to ``dataset_info.json``. Reading the streams directly keeps
``datasets`` (and its dependencies) out of the package: pyarrow, the ``parquet`` extra, is enough.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from seektrain.errors import UserError

_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")


def looks_like_datasets_folder(folder: Path) -> bool:
    """A folder with any of the files ``save_to_disk`` writes: read as one, or refused as a broken one."""
    return any((folder / name).is_file() for name in _MARKERS) or any(folder.glob("*.arrow"))


def data_files(folder: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in ``state.json`` order; UserError for anything else."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        example = f"{folder / splits[0]}" if splits else f"{folder}/train"
        raise UserError(
            f"--input {folder}: a DatasetDict folder (dataset_dict.json) holds one folder per split; "
            f"pass a split's folder, e.g. {example}"
        )
    state_file = folder / "state.json"
    if not state_file.is_file() or not (folder / "dataset_info.json").is_file():
        missing = "state.json" if not state_file.is_file() else "dataset_info.json"
        raise UserError(
            f"--input {folder}: not a Hugging Face datasets folder (no {missing}); pass the folder "
            "Dataset.save_to_disk wrote, or files in a known format"
        )
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{state_file}: unreadable ({err}); save the dataset again") from None
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(listed, list) or not listed:
        raise UserError(f"{state_file}: no _data_files list of Arrow files; save the dataset again")
    files = []
    for entry in listed:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            raise UserError(f"{state_file}: _data_files names {name!r}, not an Arrow file of this folder")
        files.append(folder / name)
    return files


def arrow_rows(folder: Path) -> Iterator[tuple[str, Any]]:
    """``(FILE: row N, row)`` for every row of the folder's Arrow files."""
    try:
        import pyarrow as pa
    except ImportError:
        raise UserError(
            f"{folder}: reading a datasets folder needs pyarrow; pip install 'seektrain[parquet]'"
        ) from None
    for path in data_files(folder):
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        except (OSError, pa.ArrowInvalid) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UserError(f"{path}: not an Arrow stream file ({first}); save the dataset again") from None
        row = 0
        for batch in reader:
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", record
