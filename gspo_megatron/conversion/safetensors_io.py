"""Hugging Face safetensors checkpoints, read and written one tensor at a time.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of
JSON (``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``, padded with
spaces to a multiple of 8), then the raw little-endian tensor bytes.

The offline converters mostly do not read tensors: ``HFCheckpoint.piece`` gives a tensor's byte range
and ``SafetensorsWriter.copy`` fills a tensor from byte ranges of other files (``byte_ranges``).
``read`` (for the trainer) uses plain positioned reads into a fresh tensor rather than a memory map: a
mapped file's pages count as the process's resident memory while mapped, and the converters must stay
far below the checkpoint's size. Writing knows every tensor's name, dtype and shape in advance (from the
model config), so each shard's header is written first and tensors land at their offsets in any order.
The byte layout (tensors sorted by dtype, then name; compact JSON) is the safetensors library's own, so
a shard written here is byte-identical to ``safetensors.torch.save_file`` of the same tensors.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import struct
import threading
from pathlib import Path
from typing import Iterable

import torch

from gspo_megatron.conversion.byte_ranges import Piece, copy_pieces
from gspo_megatron.conversion.errors import ConversionError, name_list, read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# The safetensors library orders tensors in a file by its Dtype enum (descending), then by name.
_DTYPE_RANK = {name: rank for rank, name in enumerate(
    ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
     "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"])}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    spec: TensorSpec
    path: Path
    offset: int  # absolute byte offset of the data in ``path``


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Names, dtypes, shapes and byte offsets of the tensors in one .safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ConversionError(f"{path}: header length {header_len} exceeds the file size {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConversionError(f"{path}: the safetensors header is not valid JSON ({err})") from None
    data_start = 8 + header_len
    out: dict[str, StoredTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ConversionError(f"{path}: {name}: unsupported dtype {info['dtype']}")
        spec = TensorSpec(name, tuple(int(s) for s in info["shape"]), DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        if end - begin != spec.nbytes or data_start + end > size:
            raise ConversionError(f"{path}: {name}: data_offsets {info['data_offsets']} do not fit "
                                  f"shape {list(spec.shape)} {info['dtype']} in a {size}-byte file")
        out[name] = StoredTensor(spec, path, data_start + begin)
    return out


def declared_dtype(hf_config: dict, source: str) -> torch.dtype | None:
    """The dtype a config.json declares for its weights (``dtype``, or the older ``torch_dtype``), if any."""
    name = hf_config.get("dtype", hf_config.get("torch_dtype"))
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConversionError(f"{source}: dtype: {name!r} is not a floating-point torch dtype")
    return dtype


def check_declared_dtype(folder) -> None:
    """Refuse tensors that would load silently as something other than the folder's config.json says: any
    integer or bool tensor, and a float one narrower than (or another 16-bit format than) the declared
    dtype, e.g. an fp16 or int32 tensor in an fp32 checkpoint. Wider ones stay (DeepSeek-V3's bf16 release
    keeps its router bias in fp32). ``folder``: an ``HFCheckpoint`` or a view of one (``directory``, and
    ``tensors``: name -> anything with ``spec`` and ``path``)."""
    source = str(folder.directory / "config.json")
    declared = declared_dtype(read_json(source), source)
    wrong = [f"{t.path.name}: {name} {t.spec.dtype}".replace("torch.", "") for name, t in sorted(folder.tensors.items())
             if not t.spec.dtype.is_floating_point or (declared is not None and t.spec.dtype != declared
                                                        and t.spec.dtype.itemsize <= declared.itemsize)]
    if wrong:
        what = f"declares {str(declared).removeprefix('torch.')}" if declared is not None else "declares no dtype"
        raise ConversionError(f"{source} {what}, but {len(wrong)} tensor(s) are stored otherwise: "
                              f"{'; '.join(wrong[:8])}{f' (+{len(wrong) - 8} more)' if len(wrong) > 8 else ''}")


WRITEBACK_BYTES = 64 * 2**20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _load_sync_file_range():
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # glibc / musl on Linux
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to the disk now (Linux sync_file_range; elsewhere a no-op).
    A streaming writer otherwise fills the page cache and its final fsync writes everything at once. The
    pages stay cached. The call itself blocks while the device's queue is full (10-20 ms a call here),
    so the converters make it on a thread of their own (``BackgroundWriteback``)."""
    if _sync_file_range is None:
        return
    if _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


class BackgroundWriteback:
    """Starts the disk writes of files being written, on its own thread, so that the disk works while the
    writer keeps copying and the final fsync has little left to do (ctypes calls release the GIL).

    ``kick(fd)`` asks for a writeback of ``fd`` (kicks that arrive while one runs are merged);
    ``forget(fd)`` must come before the writer closes ``fd`` (it waits for a writeback of ``fd`` in
    progress, so the number is never used after it is closed). An error on the thread is raised by the
    next ``kick`` or by ``close``. Use as a context manager.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._busy: int | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gspo-convert-writeback", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stop)
                if not self._pending:  # stopped, nothing left to start
                    return
                fd = self._busy = self._pending.pop()
            try:
                start_writeback(fd)
            except BaseException as err:  # handed to the writer's thread, raised there
                with self._cond:
                    self._error, self._stop = err, True
                    self._pending.clear()
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def kick(self, fd: int) -> None:
        with self._cond:
            self._raise_error()
            self._pending.add(fd)
            self._cond.notify_all()

    def forget(self, fd: int) -> None:
        with self._cond:
            self._pending.discard(fd)
            self._cond.wait_for(lambda: self._busy != fd)

    def close(self, raise_error: bool = True) -> None:
        """Start what was kicked, then stop the thread; ``raise_error=False`` when the caller is already
        failing (drop what was kicked, keep the caller's error)."""
        with self._cond:
            self._stop = True
            if not raise_error:
                self._pending.clear()
            self._cond.notify_all()
        self._thread.join()
        if raise_error:
            self._raise_error()

    def __enter__(self) -> "BackgroundWriteback":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_error=exc_type is None)


def read_exact(fd: int, path: Path, offset: int, out: torch.Tensor) -> None:
    """Positioned reads (no shared file position), so several threads may read one file."""
    view = memoryview(out.numpy()).cast("B")
    done = 0
    while done < len(view):  # a single read returns at most ~2 GiB on Linux
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise ConversionError(f"{path}: file ends before byte {offset + len(view)}")
        done += n


def check_index_files(weight_map: dict, index_path: Path) -> None:
    """Each ``weight_map`` entry names a file of the index's own folder by its bare name: an entry such as
    ``../x`` or ``/etc/x`` is refused by name before anything is opened (the converter reads only the model
    folder, and an error quoting a foreign file's first bytes would leak them)."""
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or os.path.basename(file) != file:
            raise ConversionError(f"{index_path}: weight_map[{str(name)[:200]!r}]: {str(file)[:200]!r} is not a file "
                                  f"name inside {index_path.parent} (never opened)")


class HFCheckpoint:
    """The tensors of a Hugging Face model folder (index + shards, or one model.safetensors), read lazily.

    Use as a context manager; ``read(name)`` returns a fresh tensor (no memory map behind it) and may be
    called from several threads.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index_path = self.directory / INDEX_NAME
        self.index: dict | None = None
        if index_path.is_file():
            self.index = read_json(index_path)
            if not isinstance(self.index, dict) or not isinstance(self.index.get("weight_map"), dict):
                raise ConversionError(f"{index_path}: weight_map: missing (expected an object of name -> file)")
            check_index_files(self.index["weight_map"], index_path)
            files = sorted(set(self.index["weight_map"].values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise ConversionError(f"{index_path}: weight_map names files that do not exist: {name_list(missing)}")
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise ConversionError(f"{self.directory}: no {INDEX_NAME} and no *.safetensors files")
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            for name, stored in read_header(self.directory / file).items():
                if name in self.tensors:
                    raise ConversionError(f"{self.directory}: tensor {name} appears in both "
                                          f"{self.tensors[name].path.name} and {file}")
                self.tensors[name] = stored
        if self.index is not None:
            listed = set(self.index["weight_map"])
            for name, stored in self.tensors.items():
                if name in listed and self.index["weight_map"][name] != stored.path.name:
                    raise ConversionError(f"{index_path}: {name}: index says {self.index['weight_map'][name]}, "
                                          f"the tensor is in {stored.path.name}")
            if listed - set(self.tensors):
                raise ConversionError(f"{index_path}: tensors listed in the index but in no file: "
                                      f"{name_list(listed - set(self.tensors))}")
            if set(self.tensors) - listed:
                raise ConversionError(f"{index_path}: tensors in the files but not in the index: "
                                      f"{name_list(set(self.tensors) - listed)}")
        paths = {t.path for t in self.tensors.values()}
        self._fds: dict[Path, int] = {path: os.open(path, os.O_RDONLY) for path in paths}

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read(self, name: str) -> torch.Tensor:
        stored = self.tensors[name]
        raw = torch.empty(stored.spec.nbytes, dtype=torch.uint8)
        read_exact(self._fds[stored.path], stored.path, stored.offset, raw)
        return raw.view(stored.spec.dtype).reshape(stored.spec.shape)

    @property
    def fds(self) -> dict[Path, int]:
        """The open file of each shard (read-only, closed with the checkpoint)."""
        return self._fds

    def piece(self, name: str) -> Piece:
        """The tensor's bytes in its file, for copying them without reading them here."""
        stored = self.tensors[name]
        return Piece(self._fds[stored.path], stored.offset, stored.spec.nbytes, str(stored.path))

    def location(self, name: str) -> tuple[str, int]:
        """(file name, byte offset): sort reads by it to read each file front to back."""
        stored = self.tensors[name]
        return stored.path.name, stored.offset


class SafetensorsWriter:
    """Writes one .safetensors file whose tensors are known up front; ``write`` (a tensor) or ``copy``
    (byte ranges of other files) them in any order."""

    def __init__(self, path: Path, specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None,
                 writeback: BackgroundWriteback | None = None):
        self.path = path
        self._writeback = writeback  # None: start the disk writes on this thread
        ordered = sorted(specs, key=lambda s: (-_DTYPE_RANK[DTYPE_NAMES[s.dtype]], s.name))
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        self._slots: dict[str, tuple[TensorSpec, int]] = {}
        position = 0
        for spec in ordered:
            header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [position, position + spec.nbytes]}
            self._slots[spec.name] = (spec, position)
            position += spec.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._data_start = 8 + len(blob)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, struct.pack("<Q", len(blob)) + blob)
        os.ftruncate(self._fd, self._data_start + position)
        self._written: set[str] = set()
        self._unflushed = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec, position = self._claim(name)
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ConversionError(f"{self.path.name}: {name}: got {list(tensor.shape)} {tensor.dtype}, "
                                  f"planned {list(spec.shape)} {spec.dtype}")
        data = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], self._data_start + position + done)
        self._wrote(name, len(data))

    def copy(self, name: str, pieces: list[Piece]) -> None:
        """Write tensor ``name`` from byte ranges of other files (its bytes in order), in the kernel."""
        spec, position = self._claim(name)
        nbytes = sum(p.nbytes for p in pieces)
        if nbytes != spec.nbytes:
            raise ConversionError(f"{self.path.name}: {name}: got {nbytes} bytes, planned {list(spec.shape)} "
                                  f"{spec.dtype} ({spec.nbytes} bytes)")
        copy_pieces(pieces, self._fd, self._data_start + position, str(self.path))
        self._wrote(name, nbytes)

    def _claim(self, name: str) -> tuple[TensorSpec, int]:
        if name not in self._slots:
            raise ConversionError(f"{self.path.name}: {name}: not planned for this shard")
        if name in self._written:
            raise ConversionError(f"{self.path.name}: {name}: written twice")
        return self._slots[name]

    def _wrote(self, name: str, nbytes: int) -> None:
        self._written.add(name)
        self._unflushed += nbytes
        if self._unflushed >= WRITEBACK_BYTES:
            if self._writeback is None:
                start_writeback(self._fd)
            else:
                self._writeback.kick(self._fd)
            self._unflushed = 0

    @property
    def complete(self) -> bool:
        return len(self._written) == len(self._slots)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        missing = set(self._slots) - self._written
        if missing:
            raise ConversionError(f"{self.path.name}: tensors never written: {name_list(missing)}")
        os.fsync(self._fd)
        self.abort()

    def abort(self) -> None:
        """Release the file without checking or syncing it (the caller is discarding it)."""
        if self._writeback is not None:
            self._writeback.forget(self._fd)
        os.close(self._fd)
        self._fd = -1


@dataclasses.dataclass
class ShardPlan:
    files: dict[str, list[TensorSpec]]  # file name -> its tensors
    index: dict | None  # model.safetensors.index.json content, None for a single model.safetensors


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int, template_index: dict | None = None) -> ShardPlan:
    """Assign tensors to files: the template's assignment when it names exactly these tensors (so a
    round trip reproduces the index), else in order, starting a new file before ``max_shard_bytes``
    would be exceeded (a larger tensor gets a file of its own)."""
    if max_shard_bytes < 1:
        raise ConversionError(f"--max-shard-bytes must be >= 1, got {max_shard_bytes}")
    names = [s.name for s in specs]
    if template_index is not None and set(template_index["weight_map"]) == set(names):
        weight_map = template_index["weight_map"]
        files: dict[str, list[TensorSpec]] = {}
        for spec in specs:
            files.setdefault(weight_map[spec.name], []).append(spec)
        return ShardPlan(files, _index(specs, weight_map))
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    if len(groups) == 1:
        return ShardPlan({SINGLE_NAME: groups[0]}, None)
    files = {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups)}
    return ShardPlan(files, _index(specs, {s.name: file for file, group in files.items() for s in group}))


def _index(specs: list[TensorSpec], weight_map: dict[str, str]) -> dict:
    return {"metadata": {"total_parameters": sum(s.numel for s in specs), "total_size": sum(s.nbytes for s in specs)},
            "weight_map": dict(sorted(weight_map.items()))}


def write_index(directory: Path, index: dict) -> None:
    """The index as transformers writes it (sorted keys, 2-space indent, trailing newline)."""
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
