"""Row readers: JSONL, Parquet, and folders written by ``datasets.Dataset.save_to_disk``.

Each reader yields ``(location, row)`` where ``location`` names the file and line (JSONL) or row (1-based)
so validation errors can point at the offending record. The ``datasets`` package is not needed: a
saved folder is read with pyarrow (its ``state.json`` lists Arrow IPC *stream* files, and a
``DatasetDict`` folder has ``dataset_dict.json`` listing split sub-folders).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Union


class DatasetError(ValueError):
    """A dataset file or row is invalid; the message starts with the file and line/row."""


@dataclasses.dataclass(frozen=True)
class InvalidLine:
    """A JSONL line that holds no record (bad bytes, bad JSON, not an object); the loader raises or
    skips it per ``data.on_invalid_row``, like any other invalid row."""

    reason: str


Row = Union[dict[str, Any], InvalidLine]


def detect_format(path: str, configured: str) -> str:
    if configured != "auto":
        return configured
    if os.path.isdir(path):
        return "hf_disk"
    lower = path.lower()
    if lower.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    raise DatasetError(f"{path}: cannot tell the format from the name; set data.format "
                       "(jsonl, parquet or hf_disk)")


def parse_jsonl_line(raw: bytes) -> Row | None:
    """One JSONL line (bytes, as read): the record, ``InvalidLine`` saying why there is none, or None
    for a blank line (e.g. a trailing newline)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return InvalidLine(f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})")
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        return InvalidLine(f"invalid JSON ({err.msg} at column {err.colno})")
    if not isinstance(row, dict):
        return InvalidLine(f"expected a JSON object, got {type(row).__name__}")
    return row


def read_jsonl(path: str) -> Iterator[tuple[str, Row]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            row = parse_jsonl_line(raw)
            if row is not None:
                yield f"{path}:{lineno}", row


def read_parquet(path: str) -> Iterator[tuple[str, Row]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{path}: not a readable Parquet file ({err})") from None
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            index += 1
            yield f"{path} row {index}", row


def _hf_split_dir(path: str, split: str | None) -> str:
    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.exists(dict_file):
        with open(dict_file, encoding="utf-8") as f:
            splits = json.load(f)["splits"]
        if split is None:
            raise DatasetError(f"{path}: a DatasetDict folder with splits {splits}; set data.hf_split "
                               "(or data.eval_hf_split)")
        if split not in splits:
            raise DatasetError(f"{path}: no split {split!r} (splits: {splits})")
        return os.path.join(path, split)
    if split is not None:
        raise DatasetError(f"{path}: a single-split dataset folder, but a split ({split!r}) was asked for")
    return path


def read_hf_disk(path: str, split: str | None = None) -> Iterator[tuple[str, Row]]:
    import pyarrow as pa

    folder = _hf_split_dir(path, split)
    state_file = os.path.join(folder, "state.json")
    if not os.path.exists(state_file):
        raise DatasetError(f"{folder}: no state.json; not a folder written by datasets' save_to_disk")
    with open(state_file, encoding="utf-8") as f:
        state = json.load(f)
    if state.get("_indices_data_files"):
        raise DatasetError(f"{folder}: has an indices mapping; save it again after dataset.flatten_indices()")
    for entry in state["_data_files"]:
        arrow_path = os.path.join(folder, entry["filename"])
        with pa.memory_map(arrow_path, "r") as source:
            reader = pa.ipc.open_stream(source)
            index = 0
            for batch in reader:
                for row in batch.to_pylist():
                    index += 1
                    yield f"{arrow_path} row {index}", row


def read_rows(path: str, fmt: str = "auto", split: str | None = None) -> Iterator[tuple[str, Row]]:
    """``(location, row)`` for every record of ``path``."""
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file or folder")
    fmt = detect_format(path, fmt)
    if fmt == "jsonl":
        return read_jsonl(path)
    if fmt == "parquet":
        return read_parquet(path)
    if fmt == "hf_disk":
        return read_hf_disk(path, split)
    raise DatasetError(f"{path}: unknown format {fmt!r}")


__all__ = ["DatasetError", "InvalidLine", "detect_format", "read_hf_disk", "read_jsonl", "read_parquet", "read_rows"]
