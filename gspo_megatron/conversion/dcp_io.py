"""Megatron dist_checkpointing (``torch_dist``) checkpoints, written and read one tensor at a time.

A torch_dist checkpoint is a PyTorch Distributed Checkpoint (DCP: ``.metadata`` + ``__R_F.distcp`` data
files) plus Megatron's ``metadata.json`` and ``common.pt``. Its keys are those of the model's
``sharded_state_dict()``: one global tensor per parameter kind, with the layer and expert numbers as
leading axes (``model.decoder.layers.mlp.experts.experts.linear_fc1.weight`` is
[layers, experts, 2F, h]). Which key, global shape and offset each canonical parameter has is not
restated here: ``checkpoint_layout`` asks Megatron, by building the model at TP=PP=EP=1 on the meta
device (no memory) and reading its sharded state dict. A checkpoint written with one chunk per canonical
tensor at those offsets is what a single process would save, and Megatron loads it at any TP/PP/EP
layout (DCP reads the overlap of each rank's request with the stored chunks).

Both directions move bytes, not tensors, wherever they can (``byte_ranges``): every chunk DCP stores is a
``torch.save`` record, a small zip around the tensor's raw bytes (``torch_records``). Writing runs DCP's
own save (planning, ``.metadata``) with a writer that builds each record from torch.save's bytes for
that shape and copies the data into it from the source files. Reading plans every request against the
stored chunks once with DCP's resharding helper; ``segments`` then locates a request's bytes inside the
records, and ``read`` loads what cannot be located that way (``torch.load`` of each file range, as DCP's
``FileSystemReader`` does).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from gspo_megatron.conversion.byte_ranges import Piece, Segment, contiguous_span, copy_pieces, pwrite_all
from gspo_megatron.conversion.errors import ConversionError, name_list
from gspo_megatron.conversion.safetensors_io import WRITEBACK_BYTES, BackgroundWriteback
from gspo_megatron.conversion.tables import VOCAB_PARAMS
from gspo_megatron.conversion.torch_records import FileSlice, PlainRecord, plain_record, record_template
from gspo_megatron.megatron.model_config import ModelConfig

PREFIX = "model."  # the prefix megatron/checkpoint.py gives the model's keys
EMBEDDING_KEY = PREFIX + "embedding.word_embeddings.weight"  # tied models keep their output layer under it


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Where one canonical tensor lives in the checkpoint: key, global shape and its offsets there.

    A vocabulary tensor of a padded layout is stored as one chunk of ``shape[0] + padding_rows`` rows:
    the canonical (unpadded) rows, then zero rows up to Megatron's padded vocabulary."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]  # the canonical tensor's own shape (trailing axes of the chunk), unpadded
    padding_rows: int = 0  # zero rows stored after the canonical rows (vocabulary padding)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The canonical tensor's box in the global tensor (what a reader requests)."""
        return (1,) * (len(self.global_shape) - len(self.shape)) + self.shape

    @property
    def stored_sizes(self) -> tuple[int, ...]:
        """The stored chunk's box: ``sizes`` with the padding rows."""
        lead = len(self.global_shape) - len(self.shape)
        return (1,) * lead + (self.shape[0] + self.padding_rows, *self.shape[1:])


@dataclasses.dataclass
class CheckpointLayout:
    chunks: dict[str, Chunk]  # canonical name -> chunk
    objects: dict[str, object]  # DCP key -> ShardedObject data (the linear layers' _extra_state)


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A one-process group (gloo on CPU, NCCL on GPU; in-memory store, no port) with Megatron's groups
    at TP=PP=EP=1."""
    from gspo_megatron.megatron import parallel

    if dist.is_initialized():
        raise ConversionError("offline conversion runs in its own process: torch.distributed is already "
                              "initialised here (use conversion.export.export_hf_tensors inside a job)")
    excepthook = sys.excepthook  # init_process_group prefixes tracebacks with "[rank0]:" for good
    dist.init_process_group(parallel.default_backend(), store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel.initialize_model_parallel(parallel.ParallelConfig())
        yield
    finally:
        parallel.destroy()
        sys.excepthook = excepthook


def _meta_model(config: ModelConfig, vocab_rows: int):
    """The whole GPTModel at TP=PP=EP=1 on the meta device, with the local (non-TE) spec and
    ``vocab_rows`` embedding/output rows."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from gspo_megatron.megatron.model import transformer_config
    from gspo_megatron.megatron.parallel import ParallelConfig

    tc = dataclasses.replace(transformer_config(config, ParallelConfig()), perform_initialization=False,
                             use_cpu_initialization=True, moe_grouped_gemm=False)
    specs = {moe: get_gpt_layer_local_spec(num_experts=config.num_experts if moe else None, moe_grouped_gemm=False,
                                           qk_layernorm=config.qk_layernorm, normalization="RMSNorm",
                                           multi_latent_attention=config.is_mla)
             for moe in (True, False)}
    if config.is_mla:
        from gspo_megatron.megatron.model import local_mla_spec

        specs = {moe: local_mla_spec(spec, config) for moe, spec in specs.items()}
    block = TransformerBlockSubmodules(layer_specs=[specs[config.is_moe_layer(i)] for i in range(config.num_layers)],
                                       layer_norm=WrappedTorchNorm)
    with torch.device("meta"):
        return GPTModel(config=tc, transformer_layer_spec=block, vocab_size=vocab_rows,
                        max_sequence_length=config.max_position_embeddings, pre_process=True, post_process=True,
                        share_embeddings_and_output_weights=config.tie_word_embeddings,
                        position_embedding_type="rope", rotary_base=int(config.rope_theta),
                        rotary_percent=config.rotary_percent)


def checkpoint_layout(config: ModelConfig, padded_vocab: int | None = None,
                      per_layer: bool | None = None) -> CheckpointLayout:
    """Key, global shape and offsets of every canonical parameter, as Megatron's sharded_state_dict
    names them (needs ``single_process_megatron``). With ``padded_vocab`` (``ModelConfig.padded_vocab_size``
    of a TP size) the vocabulary tensors' global shape has that many rows, the last ones padding;
    without, the vocabulary is unpadded (enough to read: a reader requests the canonical rows only).
    ``per_layer``: the layer keying of the checkpoint to read (``sharding.layer_keys``; None: the config's)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    from gspo_megatron.megatron.sharding import layer_keys

    vocab_rows = config.vocab_size if padded_vocab is None else padded_vocab
    if vocab_rows < config.vocab_size:
        raise ValueError(f"checkpoint_layout: padded_vocab={vocab_rows} < vocab_size={config.vocab_size}")
    model = _meta_model(config, vocab_rows)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # buffers: the routers' expert bias
    with layer_keys(model, per_layer):
        state = model.sharded_state_dict(prefix=PREFIX)
    apply_factories(state)  # SwiGLU fc1 becomes its gate and up halves (two chunks of one key)
    chunks: dict[str, Chunk] = {}
    objects: dict[str, object] = {}
    for name, value in state.items():
        if isinstance(value, ShardedObject):
            objects[value.unique_key] = value.data
            continue
        pieces = value if isinstance(value, list) else [value]
        if not all(isinstance(p, ShardedTensor) for p in pieces) or len({p.key for p in pieces}) != 1:
            raise RuntimeError(f"checkpoint_layout: unexpected sharded entry {name}: {pieces}")
        canonical = name.removeprefix(PREFIX)
        param = params[canonical]
        offsets = tuple(min(p.global_offset[d] for p in pieces) for d in range(len(pieces[0].global_shape)))
        shape, padding = tuple(param.shape), 0
        if canonical in VOCAB_PARAMS:
            shape, padding = (config.vocab_size, *shape[1:]), shape[0] - config.vocab_size
        chunk = Chunk(pieces[0].key, tuple(pieces[0].global_shape), offsets, shape, padding)
        if sum(math.prod(p.local_shape) for p in pieces) != param.numel():
            raise RuntimeError(f"checkpoint_layout: the pieces of {name} do not add up to {tuple(param.shape)}")
        chunks[canonical] = chunk
    return CheckpointLayout(chunks, objects)


# ---- writing -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlannedChunk:
    chunk: Chunk
    dtype: torch.dtype
    pieces: list[Piece]  # the stored chunk's bytes in order (byte_ranges.canonical_pieces, then padding)
    name: str  # canonical name, for error messages

    @property
    def nbytes(self) -> int:
        return math.prod(self.chunk.stored_sizes) * self.dtype.itemsize


class _ChunkPlanner(SavePlanner):
    """A DCP SavePlanner over chunks that exist only as byte ranges of the source files: it plans
    (Megatron's keys, offsets, global shapes) and _RecordWriter writes; nothing is resolved to tensors."""

    def __init__(self, planned: list[PlannedChunk], object_keys: list[str]):
        self.items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in object_keys]
        self.chunks: dict[MetadataIndex, PlannedChunk] = {}
        for p in planned:
            index = MetadataIndex(p.chunk.key, torch.Size(p.chunk.offsets))
            self.items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.chunk.offsets),
                                               sizes=torch.Size(p.chunk.stored_sizes)),
                    properties=TensorProperties(dtype=p.dtype), size=torch.Size(p.chunk.global_shape))))
            self.chunks[index] = p

    # the SavePlanner protocol (torch.distributed.checkpoint.planner.SavePlanner)
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self):
        return SavePlan(items=self.items)

    def create_global_plan(self, all_plans):
        plans, metadata = create_default_global_save_plan(all_plans)
        _check_coverage(metadata)
        return plans, metadata

    def finish_plan(self, new_plan):
        return new_plan

    def resolve_data(self, write_item):
        raise RuntimeError(f"{write_item.index}: _RecordWriter copies the chunks' bytes; nothing resolves tensors")


class _RecordWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (planning, ``.metadata``) with its data step replaced: one file per rank,
    as ``single_file_per_rank`` writes it (objects, then tensor records, each at the offset its
    ``_StorageInfo`` names), but each tensor record is ``torch.save``'s zip built around the data
    (``torch_records.record_template``) and the data is copied from the source files in the kernel.
    The disk writes start every WRITEBACK_BYTES on a background thread; the file is fsynced at the end."""

    def __init__(self, directory: Path, objects: dict[str, bytes], on_write: Callable[[int], None]):
        super().__init__(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        self._directory = directory
        self._objects = objects
        self._on_write = on_write

    def write_data(self, plan, planner: _ChunkPlanner):
        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        path = self._directory / file_name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with BackgroundWriteback() as writeback:  # stopped (no longer using fd) when the block ends
                results = self._write_records(fd, file_name, path, plan, planner, writeback)
            os.fsync(fd)
        finally:
            os.close(fd)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_records(self, fd: int, file_name: str, path: Path, plan, planner: _ChunkPlanner,
                       writeback: BackgroundWriteback) -> list[WriteResult]:
        results, position, unflushed = [], 0, 0
        for item in sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO):  # objects first, as DCP
            start = position
            if item.type == WriteItemType.BYTE_IO:
                position += pwrite_all(fd, self._objects[item.index.fqn], position)
            else:
                source = planner.chunks[item.index]
                if sum(p.nbytes for p in source.pieces) != source.nbytes:
                    raise ConversionError(f"{source.name}: the source bytes add up to "
                                          f"{sum(p.nbytes for p in source.pieces)}, the model needs "
                                          f"{list(source.chunk.stored_sizes)} {source.dtype} ({source.nbytes} bytes)")
                prefix, suffix = record_template(source.chunk.stored_sizes, source.dtype)
                position += pwrite_all(fd, prefix, position)
                position += copy_pieces(source.pieces, fd, position, str(path))
                position += pwrite_all(fd, suffix, position)
                self._on_write(source.nbytes)
                unflushed += source.nbytes
            results.append(WriteResult(index=item.index, size_in_bytes=position - start,
                                       storage_data=_StorageInfo(file_name, start, position - start)))
            if unflushed >= WRITEBACK_BYTES:  # what is written so far goes to the disk now
                writeback.kick(fd)
                unflushed = 0
        return results


def _check_coverage(metadata) -> None:
    """Each global tensor is covered exactly once: chunk volumes add up and no offset repeats (O(n),
    instead of DCP's pairwise overlap check, which is quadratic in the 6,000 expert chunks of a key).
    The chunks come from Megatron's grid, so equal volume with distinct offsets means a partition."""
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        offsets = [tuple(c.offsets) for c in md.chunks]
        volume = sum(math.prod(c.sizes) for c in md.chunks)
        if len(set(offsets)) != len(offsets) or volume != math.prod(md.size):
            raise ConversionError(f"{key}: the planned chunks cover {volume} of {math.prod(md.size)} elements "
                                  f"({len(offsets)} chunks, {len(offsets) - len(set(offsets))} repeated)")


def write_checkpoint(directory: Path, planned: list[PlannedChunk], objects: dict[str, object],
                     on_write: Callable[[int], None]) -> None:
    """Write a torch_dist checkpoint into the (new, empty) ``directory``, chunks in the order given,
    each copied from its pieces (no tensor is loaded). ``objects``: ``CheckpointLayout.objects``."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    serialized = serialize_objects(objects)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.save({}, storage_writer=_RecordWriter(directory, serialized, on_write),
                     planner=_ChunkPlanner(planned, list(serialized)), no_dist=True)
        except CheckpointException as err:
            # DCP wraps whatever a planner raised (a BaseException carrying (exception, trace) per rank);
            # re-raise ours, e.g. a ConversionError naming the tensor, with its own traceback
            (exception, _), = err.failures.values()
            raise exception from None
    torch.save({}, directory / "common.pt")  # the model's sharded_state_dict has no common (unsharded) part
    save_config(CheckpointingConfig("torch_dist", 1), str(directory))


def serialize_objects(objects: dict[str, object]) -> dict[str, bytes]:
    """Each ShardedObject as Megatron stores it: ``torch.save`` of the list of the key's local objects.
    Objects that pickle alike serialize alike, so torch.save runs once per distinct object (258 calls,
    0.2 s, for the 258 ``_extra_state`` = None of a 48-layer MoE model otherwise)."""
    by_pickle: dict[bytes, bytes] = {}
    out = {}
    for key, data in objects.items():
        pickled = pickle.dumps(data, protocol=2)
        if pickled not in by_pickle:
            buffer = io.BytesIO()
            torch.save([data], buffer)
            by_pickle[pickled] = buffer.getvalue()
        out[key] = by_pickle[pickled]
    return out


# ---- reading -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
    name: str  # canonical name
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]  # canonical shape (sizes without the leading singleton axes)
    dtype: torch.dtype


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class CheckpointReader:
    """Reads canonical tensors (any chunking: a converted checkpoint or one saved by training at any
    TP/PP/EP layout) from a torch_dist checkpoint, in bounded batches."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / ".metadata").is_file():
            raise ConversionError(f"{self.directory}: not a torch_dist checkpoint (no .metadata)")
        self._reader = dcp.FileSystemReader(str(self.directory))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)
        self._by_lead: dict[str, dict | None] = {}
        self._fds: dict[str, int] = {}
        self._records: dict[MetadataIndex, PlainRecord | None] = {}
        self._chunk_sizes: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}

    def tensor_keys(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Global shape and dtype of every tensor key in the checkpoint."""
        return {key: (tuple(md.size), md.properties.dtype) for key, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)}

    def plan(self, requests: list[Request]) -> dict[str, list]:
        """Read items per request name, after checking that the stored chunks cover every request."""
        items: dict[str, list] = {r.name: [] for r in requests}
        for r in requests:
            local = ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes))
            for item in create_read_items_for_chunk_list(r.key, self._candidates(r), [local]):
                items[r.name].append(item)
        for r in requests:
            covered = sum(math.prod(item.lengths) for item in items[r.name])
            if covered != math.prod(r.sizes):
                raise ConversionError(f"{self.directory}: {r.key}: the stored chunks cover {covered} of the "
                                      f"{math.prod(r.sizes)} elements of {r.name} (offsets {list(r.offsets)})")
        return items

    def _candidates(self, request: Request) -> TensorStorageMetadata:
        """The stored chunks of ``request.key`` that can overlap the request: those at the request's
        (layer, expert) offsets. Megatron chunks the leading (layer, expert) axes one by one; handing
        DCP every chunk of a key instead costs n x m overlap tests (its sweep runs along the longest
        axis, which every expert chunk spans): 37 M per key for 48 layers x 128 experts."""
        md = self.metadata.state_dict_metadata[request.key]
        lead = len(request.sizes) - len(request.shape)
        if request.key not in self._by_lead:
            index: dict[tuple[int, ...], list] = {}
            for chunk in md.chunks:
                if any(size != 1 for size in chunk.sizes[:lead]):
                    index = None  # not chunked one by one on the leading axes: search them all
                    break
                index.setdefault(tuple(chunk.offsets[:lead]), []).append(chunk)
            self._by_lead[request.key] = index
        index = self._by_lead[request.key]
        if index is None:
            return md
        return TensorStorageMetadata(md.properties, md.size, index.get(tuple(request.offsets[:lead]), []))

    def location(self, item) -> tuple[str, int]:
        info = self._reader.storage_data[item.storage_index]
        return info.relative_path, info.offset

    def segments(self, request: Request, items: list) -> list[Segment] | None:
        """The request's bytes (row-major, shape ``request.sizes``) as byte ranges of the data files,
        sorted and covering it once, when every read item is a contiguous run on both sides of a plain
        record of the request's dtype: a converted checkpoint's chunks, or row slices (TP on dim 0, EP,
        PP, a padded vocabulary's first rows) of one saved by training. None otherwise (column slices,
        stream transforms, another dtype, a record torch.save did not write as one plain tensor)."""
        itemsize = request.dtype.itemsize
        out = []
        for item in items:
            info = self._reader.storage_data[item.storage_index]
            record = None if info.transform_descriptors else self._record(item.storage_index)
            if record is None or record.dtype != request.dtype:
                return None
            source = contiguous_span(item.storage_offsets, item.lengths, record.shape)
            dest = contiguous_span(item.dest_offsets, item.lengths, request.sizes)
            if source is None or dest is None:
                return None
            path = self.directory / info.relative_path
            piece = Piece(self._fd(info.relative_path), info.offset + record.data_offset + source[0] * itemsize,
                          source[1] * itemsize, str(path))
            out.append(Segment(dest[0] * itemsize, piece))
        return sorted(out)

    def _record(self, index: MetadataIndex) -> PlainRecord | None:
        if index not in self._records:
            info = self._reader.storage_data[index]
            md = self.metadata.state_dict_metadata[index.fqn]
            if index.fqn not in self._chunk_sizes:
                self._chunk_sizes[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
            sizes = self._chunk_sizes[index.fqn][tuple(index.offset)]
            record = FileSlice(self._fd(info.relative_path), info.offset, info.length)
            self._records[index] = plain_record(record, sizes, md.properties.dtype)
        return self._records[index]

    def read(self, requests: list[Request], items: dict[str, list]) -> dict[str, torch.Tensor]:
        """The canonical tensors of ``requests`` (read items from ``plan``), each file read front to back.

        DCP stores every chunk as a torch.save record; a record that is a whole request (a converted
        checkpoint's chunks are) is used as loaded, without the copy into a buffer that DCP's own
        FileSystemReader makes; pieces (e.g. TP slices saved by training) are copied into place.
        """
        out: dict[str, torch.Tensor] = {}
        reads = sorted(((r, item) for r in requests for item in items[r.name]),
                       key=lambda pair: self.location(pair[1]))
        for request, item in reads:
            info = self._reader.storage_data[item.storage_index]
            if info.transform_descriptors:
                raise ConversionError(f"{self.directory}: {request.key}: stored with stream transforms "
                                      f"{info.transform_descriptors}, which this reader does not apply")
            fd = self._fd(info.relative_path)
            stored = torch.load(FileSlice(fd, info.offset, info.length), map_location="cpu", weights_only=True)
            piece = _narrow(stored, item.storage_offsets, item.lengths)
            if len(items[request.name]) == 1 and tuple(piece.shape) == request.sizes and piece.dtype == request.dtype:
                out[request.name] = piece.reshape(request.shape)
                continue
            if request.name not in out:
                out[request.name] = torch.empty(request.sizes, dtype=request.dtype)
            _narrow(out[request.name], item.dest_offsets, item.lengths).copy_(piece)
        return {r.name: out[r.name].reshape(r.shape) for r in requests}

    def _fd(self, relative_path: str) -> int:
        if relative_path not in self._fds:
            self._fds[relative_path] = os.open(self.directory / relative_path, os.O_RDONLY)
        return self._fds[relative_path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def requests_for(layout: CheckpointLayout, reader: CheckpointReader, vocab_size: int) -> list[Request]:
    """One request per canonical tensor, after checking the checkpoint's keys and shapes against the
    model (missing and unexpected ``model.`` keys are errors; other prefixes, e.g. optimizer state, are
    ignored). Vocabulary rows are padded (``ModelConfig.padded_vocab_size``, by the conversion or by
    training at any TP); only the first ``vocab_size`` rows are read, so the padding is stripped by range."""
    stored = reader.tensor_keys()
    expected = {c.key for c in layout.chunks.values()}
    ours = {k for k in stored if k.startswith(PREFIX)}
    if expected - ours:
        raise ConversionError(f"{reader.directory}: missing tensors for this model config: "
                              f"{name_list(expected - ours)}")
    if ours - expected:
        raise ConversionError(f"{reader.directory}: tensors this model config does not have: "
                              f"{name_list(ours - expected)}")
    requests = []
    for name, chunk in layout.chunks.items():
        shape, dtype = stored[chunk.key]
        wanted = chunk.global_shape
        vocab_ok = name in VOCAB_PARAMS and shape[0] >= vocab_size and shape[1:] == wanted[1:]
        if shape != wanted and not vocab_ok:
            raise ConversionError(f"{reader.directory}: {chunk.key}: global shape {list(shape)} in the checkpoint, "
                                  f"{list(wanted)} from the model config")
        requests.append(Request(name, chunk.key, chunk.offsets, chunk.sizes, chunk.shape, dtype))
    return requests


# ---- vocabulary padding --------------------------------------------------------------------------

def vocab_padding_meta(config: ModelConfig, tensor_parallel: int) -> dict:
    """What a converted checkpoint's gspo_meta.json records of its padded vocabulary: the rows stored
    (``padded_vocab_size``) and what they were derived from (the TP size and Megatron-LM's divisor)."""
    return {"vocab_padding": {"vocab_size": config.vocab_size, "tensor_parallel": tensor_parallel,
                              "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by,
                              "padded_vocab_size": config.padded_vocab_size(tensor_parallel)}}


def stored_vocab_rows(directory: str | Path) -> int:
    """Rows of the embedding in a torch_dist checkpoint (the padded vocabulary it was saved with), from
    DCP's ``.metadata`` alone."""
    with CheckpointReader(directory) as reader:
        keys = reader.tensor_keys()
    if EMBEDDING_KEY not in keys:
        raise ConversionError(f"{directory}: no {EMBEDDING_KEY} in the checkpoint")
    return keys[EMBEDDING_KEY][0][0]


def check_vocab_rows(directory: str | Path, config: ModelConfig) -> int:
    """The stored vocabulary rows, after checking that they hold the whole vocabulary of ``config``.
    Megatron loads vocabulary tensors with ``allow_shape_mismatch`` (zero-filling the rows a checkpoint
    lacks, so that one padded for another TP loads), which would also load a smaller vocabulary silently."""
    rows = stored_vocab_rows(directory)
    if rows < config.vocab_size:
        raise ConversionError(f"{directory}: {EMBEDDING_KEY} has {rows} rows, fewer than the model config's "
                              f"vocab_size={config.vocab_size}: the checkpoint is of another vocabulary")
    return rows
