"""DCP's tensor records (one ``torch.save`` zip per chunk), built and parsed around their data bytes.

A ``torch.save`` of one contiguous tensor is a zip holding ``data.pkl`` (the pickled call that rebuilds
the tensor: storage type, shape, stride), a few small version entries and ``data/0``, the storage's raw
bytes, stored uncompressed. Everything but ``data/0``'s content depends only on the shape and dtype (with
the zip CRC32 off, which DCP does not check). So:

- ``record_template`` runs ``torch.save`` once per (shape, dtype) on an untouched ``torch.empty`` tensor
  into a sink that keeps every byte except the data: a record is then prefix + data + suffix, the data
  copied between files by ``byte_ranges.copy_pieces``. The bytes are torch.save's own (not a zip written
  here), so a record is byte-identical to what ``torch.save`` of the tensor writes with CRC32 off.
- ``plain_record`` returns where a stored record's data starts: when the bytes around the data are the
  template's, at once; else it reads the zip directory and ``data.pkl`` (a few hundred bytes, through
  a restricted unpickler that only accepts the rebuild of one plain tensor). None when the record is
  anything else (a legacy format, a non-contiguous or offset storage, ...): the caller then falls back
  to ``torch.load``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import math
import os
import pickle
import struct
import sys
import zipfile
from typing import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """torch.save without the zip CRC32 (it took 2/3 of torch.save's time; torch.load does not check it
    and DCP has no checksums of its own). Templates need it: a CRC of the untouched template data would
    be wrong for the real data. Process-wide while it lasts: conversion is the only work of its process."""
    from torch.utils.serialization import config

    saved = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = saved


class _SkipData(io.RawIOBase):
    """A write-only sink for torch.save that keeps the bytes around the tensor's data and only counts
    the data (recognised by address: torch.save hands over memoryviews of the tensor's memory)."""

    def __init__(self, data_ptr: int, nbytes: int):
        super().__init__()
        self._lo, self._hi = data_ptr, data_ptr + nbytes
        self.prefix, self.suffix = bytearray(), bytearray()
        self.data_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data if n else 0
        if n and self._lo <= address < self._hi:
            if self.suffix:
                raise RuntimeError("torch.save wrote the tensor data in non-adjacent pieces")
            self.data_bytes += n
        elif self.data_bytes:
            self.suffix += view
        else:
            self.prefix += view
        return n


@functools.lru_cache(maxsize=256)
def record_template(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, bytes]:
    """(prefix, suffix): ``torch.save`` of a contiguous ``shape`` ``dtype`` tensor is prefix + its raw
    bytes + suffix (CRC32 off). Costs one torch.save without the data: the tensor's memory is never read
    (its pages are never faulted in), so a 600 MB embedding costs no memory here."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    sink = _SkipData(tensor.data_ptr(), nbytes)
    with without_zip_crc32():
        torch.save(tensor, sink)
    if sink.data_bytes != nbytes:
        raise RuntimeError(f"torch.save of {list(shape)} {dtype}: {sink.data_bytes} data bytes seen, {nbytes} expected")
    return bytes(sink.prefix), bytes(sink.suffix)


# ---- reading -------------------------------------------------------------------------------------

class FileSlice(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open file (positioned reads, no shared file
    position): what one DCP record is read through."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[:max(0, self._length - self._pos)]
        n = os.preadv(self._fd, [view], self._start + self._pos) if len(view) else 0
        self._pos += n
        return n

    @property
    def length(self) -> int:
        return self._length

    def pread(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self._fd, max(0, min(nbytes, self._length - offset)), self._start + offset)


@dataclasses.dataclass(frozen=True)
class PlainRecord:
    """A record holding one contiguous tensor whose storage is exactly its elements."""

    data_offset: int  # of the first data byte, from the start of the record
    dtype: torch.dtype
    shape: tuple[int, ...]


class _NotPlain(Exception):
    """Raised inside the restricted unpickler: the record holds something other than one plain tensor."""


@dataclasses.dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclasses.dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    if not isinstance(storage, _Storage) or backward_hooks or metadata:
        raise _NotPlain
    return _Tensor(storage, storage_offset, tuple(size), tuple(stride))


class _StorageType:
    def __init__(self, name: str):
        from torch.serialization import _get_dtype_from_pickle_storage_type  # what torch.load uses

        self.dtype = _get_dtype_from_pickle_storage_type(name)


class _TensorUnpickler(pickle.Unpickler):
    """Accepts only what torch.save writes for one tensor; anything else is _NotPlain."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            return _StorageType(name)
        raise _NotPlain

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise _NotPlain
        return _Storage(pid[1].dtype, pid[2], pid[4])


def _entry_data_offset(record: FileSlice, info: zipfile.ZipInfo) -> int:
    """Where an entry's bytes start: after its local header (30 bytes, the name and the extra field,
    which torch.save uses to align data to 64 bytes)."""
    header = record.pread(info.header_offset, 30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"{info.filename}: no local header at {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def plain_record(record: FileSlice, shape: tuple[int, ...], dtype: torch.dtype) -> PlainRecord | None:
    """Where the data of a DCP tensor record starts, when it is one contiguous little-endian tensor with
    a storage of exactly its elements, stored uncompressed; None for anything else.

    ``shape`` and ``dtype`` are what DCP's metadata says the chunk is. A record whose bytes around the
    data equal ``record_template(shape, dtype)`` is that tensor (the template holds the pickled shape,
    strides and storage type, and the zip directory): two reads. Others (e.g. saved with CRC32 on, or by
    another torch version) have their zip directory and ``data.pkl`` read.
    """
    prefix, suffix = record_template(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if (record.length == len(prefix) + nbytes + len(suffix) and record.pread(0, len(prefix)) == prefix
            and record.pread(record.length - len(suffix), len(suffix)) == suffix):
        return PlainRecord(len(prefix), dtype, tuple(shape))
    return _parse_record(record)


def _parse_record(record: FileSlice) -> PlainRecord | None:
    if record.pread(0, 4) != b"PK\x03\x04":  # e.g. the legacy (pre-zip) torch.save format
        return None
    archive = zipfile.ZipFile(record)
    entries = {info.filename: info for info in archive.infolist()}
    pickles = [name for name in entries if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        return None
    prefix = pickles[0].removesuffix("data.pkl")
    pkl = entries[pickles[0]]
    if pkl.compress_type != zipfile.ZIP_STORED:
        return None
    start = _entry_data_offset(record, pkl)
    try:
        tensor = _TensorUnpickler(io.BytesIO(record.pread(start, pkl.file_size))).load()
    except _NotPlain:
        return None
    if not isinstance(tensor, _Tensor):
        return None
    byteorder = entries.get(prefix + "byteorder")
    if byteorder is None or record.pread(_entry_data_offset(record, byteorder), byteorder.file_size) != \
            sys.byteorder.encode():
        return None
    data = entries.get(f"{prefix}data/{tensor.storage.key}")
    numel = 1
    for size in tensor.shape:
        numel *= size
    itemsize = tensor.storage.dtype.itemsize
    if (data is None or data.compress_type != zipfile.ZIP_STORED or tensor.storage_offset != 0
            or tensor.storage.numel != numel or data.file_size != numel * itemsize
            or (numel > 1 and tensor.stride != _contiguous_strides(tensor.shape))):
        return None
    return PlainRecord(_entry_data_offset(record, data), tensor.storage.dtype, tensor.shape)
