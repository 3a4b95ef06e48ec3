"""The byte-level machinery on its own: transforms as row blocks, byte pieces copied between files (with
and without copy_file_range), torch.save records built around and located inside their data, and the
background writeback."""
import collections
import errno
import io
import os

import pytest
import torch

from gspo_megatron.conversion import byte_ranges, safetensors_io
from gspo_megatron.conversion.byte_ranges import (Piece, Segment, canonical_pieces, contiguous_span, copy_pieces,
                                                  hf_pieces)
from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.torch_records import FileSlice, plain_record, record_template, without_zip_crc32
from gspo_megatron.conversion.transforms import FusedGateUp, FusedQKV, Identity


@pytest.mark.parametrize("transform, shape", [
    (Identity(), (6, 5)), (Identity(), (7,)), (FusedGateUp(), (8, 3)), (FusedQKV(6, 2, 3), (30, 5)),
    (FusedQKV(4, 4, 2), (24,)), (FusedQKV(8, 1, 2), (20, 3)),
])
def test_row_blocks_are_the_tensor_transform(transform, shape):
    """The byte-copy form of each transform moves every row where to_megatron / to_hf put it."""
    hf = [torch.randn(s) for s in transform.hf_shapes(shape)]
    canonical = transform.to_megatron(hf)
    blocks = transform.row_blocks(shape)
    assert sum(b.rows for b in blocks) == shape[0]
    from_blocks = torch.full(shape, float("nan"))
    for b in blocks:
        from_blocks[b.canonical_row:b.canonical_row + b.rows] = hf[b.hf][b.hf_row:b.hf_row + b.rows]
    assert torch.equal(from_blocks, canonical)
    for i, tensor in enumerate(transform.to_hf(canonical)):
        rows = sorted((b for b in blocks if b.hf == i), key=lambda b: b.hf_row)
        assert torch.equal(torch.cat([canonical[b.canonical_row:b.canonical_row + b.rows] for b in rows]), tensor)


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_raw(raw: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=like.dtype).reshape(like.shape)


@pytest.fixture
def files(tmp_path):
    """open(name, content) -> fd of a file holding ``content``; all closed at the end."""
    fds = []

    def open_file(name: str, content: bytes = b"") -> int:
        (tmp_path / name).write_bytes(content)
        fds.append(os.open(tmp_path / name, os.O_RDWR))
        return fds[-1]

    yield open_file
    for fd in fds:
        os.close(fd)


@pytest.mark.parametrize("buffered", [False, True])
def test_byte_pieces_convert_both_ways_between_files(files, monkeypatch, buffered):
    """canonical_pieces / hf_pieces + copy_pieces write the bytes of to_megatron / to_hf, also from a
    canonical tensor stored in several row segments and when copy_file_range is refused."""
    if buffered:
        def refuse(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse)
        monkeypatch.setattr(byte_ranges, "_BUFFER_BYTES", 7)  # many partial buffers
    transform, shape = FusedQKV(6, 2, 3), (30, 5)
    hf = [torch.randn(s).to(torch.bfloat16) for s in transform.hf_shapes(shape)]
    header = b"abc"  # unaligned offsets
    src = files("hf", header + b"".join(_raw(t) for t in hf))
    offsets = [len(header) + sum(t.numel() * 2 for t in hf[:i]) for i in range(3)]
    pieces = [Piece(src, offset, t.numel() * 2, "hf") for offset, t in zip(offsets, hf)]

    canonical = transform.to_megatron(hf)
    out = files("meg")
    plan = canonical_pieces(transform.row_blocks(shape), shape, 2, pieces)
    assert copy_pieces(plan, out, 7, "meg") == canonical.numel() * 2
    assert _from_raw(os.pread(out, canonical.numel() * 2, 7), canonical).equal(canonical)

    # the canonical tensor stored as two row slices in reverse order, as a TP=2 save might
    width = 5 * 2
    stored = files("stored", _raw(canonical[12:]) + _raw(canonical[:12]))
    segments = [Segment(0, Piece(stored, 18 * width, 12 * width, "stored")),
                Segment(12 * width, Piece(stored, 0, 18 * width, "stored"))]
    back = files("back")
    position = 0
    for i, tensor_pieces in enumerate(hf_pieces(transform.row_blocks(shape), shape, 2, 3, segments)):
        n = copy_pieces(tensor_pieces, back, position, "back")
        assert _from_raw(os.pread(back, n, position), hf[i]).equal(hf[i])
        position += n


def test_copy_names_a_source_that_ends_early(files):
    src = files("short", b"x" * 10)
    with pytest.raises(ConversionError, match="short: file ends before byte 14"):
        copy_pieces([Piece(src, 4, 10, "short")], files("out"), 0, "out")


def test_contiguous_span():
    assert contiguous_span((0, 0), (4, 6), (4, 6)) == (0, 24)
    assert contiguous_span((2, 0), (2, 6), (4, 6)) == (12, 12)  # row slice
    assert contiguous_span((0, 3), (4, 3), (4, 6)) is None  # column slice
    assert contiguous_span((1, 2, 0, 0), (1, 1, 8, 4), (3, 4, 8, 4)) == (1 * 128 + 2 * 32, 32)  # expert chunk
    assert contiguous_span((1, 2, 3, 0), (1, 1, 1, 4), (3, 4, 8, 4)) == (1 * 128 + 2 * 32 + 12, 4)  # one row
    assert contiguous_span((0, 0, 0), (2, 1, 4), (2, 3, 4)) is None  # two separate rows


@pytest.mark.parametrize("shape, dtype", [((4, 8), torch.bfloat16), ((3,), torch.float32), ((1, 64, 64), torch.float16),
                                          ((5, 7, 3), torch.int64), ((2, 0), torch.float32)])
def test_record_template_is_torch_save_without_the_data(shape, dtype):
    tensor = (torch.randn(shape) * 100).to(dtype)
    buffer = io.BytesIO()
    with without_zip_crc32():
        torch.save(tensor, buffer)
    prefix, suffix = record_template(shape, dtype)
    assert buffer.getvalue() == prefix + _raw(tensor) + suffix
    loaded = torch.load(io.BytesIO(prefix + _raw(tensor) + suffix), weights_only=True)
    assert loaded.dtype == dtype and torch.equal(loaded, tensor)


def _record(files, name: str, obj, **save_args) -> FileSlice:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **save_args)  # CRC32 on: not the template's bytes
    data = buffer.getvalue()
    return FileSlice(files(name, b"leading bytes" + data), len(b"leading bytes"), len(data))


def test_plain_record_locates_the_data_of_one_plain_tensor(files):
    tensor = torch.randn(6, 4).to(torch.bfloat16)
    for record in (_record(files, "crc", tensor), _built_record(files, tensor)):
        found = plain_record(record, (6, 4), torch.bfloat16)
        assert found is not None and found.shape == (6, 4) and found.dtype == torch.bfloat16
        assert record.pread(found.data_offset, 48) == _raw(tensor)


def _built_record(files, tensor) -> FileSlice:
    prefix, suffix = record_template(tuple(tensor.shape), tensor.dtype)
    data = prefix + _raw(tensor) + suffix
    return FileSlice(files("built", b"xy" + data), 2, len(data))


def test_plain_record_declines_anything_else(files):
    tensor = torch.randn(6, 4)
    cases = {
        "transposed": (tensor.t(), (4, 6)),  # not contiguous
        "view": (tensor[2:], (4, 4)),  # torch.save keeps the whole storage: an offset, 24 elements for 16
        "dict": ({"a": tensor}, (6, 4)),
        "other object": (collections.Counter(a=1), (6, 4)),
    }
    for name, (obj, shape) in cases.items():
        assert plain_record(_record(files, name, obj), shape, torch.float32) is None, name
    legacy = _record(files, "legacy", tensor, _use_new_zipfile_serialization=False)
    assert plain_record(legacy, (6, 4), torch.float32) is None


@pytest.mark.skipif(safetensors_io._sync_file_range is None, reason="no sync_file_range here")
def test_background_writeback_starts_what_was_kicked_and_reports_errors(files, monkeypatch):
    started = []
    real = safetensors_io.start_writeback
    monkeypatch.setattr(safetensors_io, "start_writeback", lambda fd: (started.append(fd), real(fd)))
    fd = files("data", b"x" * 100_000)
    with safetensors_io.BackgroundWriteback() as writeback:
        os.pwrite(fd, b"y" * 50_000, 0)
        writeback.kick(fd)
    assert started == [fd]  # close starts what is still pending
    failing = safetensors_io.BackgroundWriteback()
    failing.kick(10**6)  # no such descriptor
    with pytest.raises(OSError, match="sync_file_range: Bad file descriptor"):
        failing.close()
