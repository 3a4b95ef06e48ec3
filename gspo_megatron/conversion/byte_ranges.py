"""Conversion as byte-range copies between files, without the tensors passing through this process.

Every transform is a permutation of whole rows (``transforms.RowBlock``), and both formats store a
tensor's rows contiguously in row-major order (safetensors: the raw bytes; a DCP record: ``torch.save``'s
storage entry). So a converted tensor is a list of ``Piece``s, byte ranges of open source files, written
back to back; ``copy_pieces`` moves them with ``copy_file_range``, which copies inside the kernel as
``cp`` does: no user-space buffer, no page faults on fresh memory, no Python-side copy.
"""
from __future__ import annotations

import bisect
import errno
import os
from typing import NamedTuple, Protocol, Sequence

from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.transforms import RowBlock

# copy_file_range refuses some file pairs (other file systems on older kernels, some special files):
# those ranges are copied through a buffer instead. Other errors (ENOSPC, EIO, ...) propagate.
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ETXTBSY, errno.EPERM}
_BUFFER_BYTES = 8 * 2**20


class Computed(Protocol):
    """A source whose bytes are computed as they are copied (e.g. a dequantized FP8 tensor): a ``Piece``
    with such an ``fd`` addresses bytes of the computed tensor, as if it were stored."""

    def write_range(self, offset: int, nbytes: int, dst_fd: int, dst_offset: int) -> None: ...

    def read_range(self, offset: int, nbytes: int) -> bytes | bytearray: ...


class Piece(NamedTuple):
    """``nbytes`` bytes at absolute offset ``offset`` of the open file ``fd`` (``path`` names it in errors),
    or of a ``Computed`` source."""

    fd: int | Computed
    offset: int
    nbytes: int
    path: str


ZEROS_FD = -1  # a Piece with this fd is ``nbytes`` zero bytes, read from no file (vocabulary padding rows)


def zeros(nbytes: int) -> Piece:
    """``nbytes`` zero bytes: the padding rows Megatron's padded vocabulary adds after the real rows."""
    return Piece(ZEROS_FD, 0, nbytes, "<zero padding>")


class Segment(NamedTuple):
    """Bytes [start, start + piece.nbytes) of a tensor are ``piece``."""

    start: int
    piece: Piece


def merged(pieces: Sequence[Piece]) -> list[Piece]:
    """Adjacent pieces of one file joined (fewer copies: e.g. an unfused tensor is one piece)."""
    out: list[Piece] = []
    for p in pieces:
        if not p.nbytes:
            continue
        last = out[-1] if out else None
        if last is not None and last.fd == p.fd and last.offset + last.nbytes == p.offset:
            out[-1] = last._replace(nbytes=last.nbytes + p.nbytes)
        else:
            out.append(p)
    return out


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one row (one slice along dim 0) of a row-major tensor of ``shape``."""
    size = itemsize
    for s in shape[1:]:
        size *= s
    return size


def canonical_pieces(blocks: Sequence[RowBlock], shape: Sequence[int], itemsize: int,
                     hf: Sequence[Piece], padding_rows: int = 0) -> list[Piece]:
    """The canonical tensor's bytes in order, as pieces of its HF tensors (``hf[i]``: all of tensor i),
    followed by ``padding_rows`` zero rows (a padded vocabulary)."""
    width = row_bytes(shape, itemsize)
    return merged([hf[b.hf]._replace(offset=hf[b.hf].offset + b.hf_row * width, nbytes=b.rows * width)
                   for b in sorted(blocks, key=lambda b: b.canonical_row)] + [zeros(padding_rows * width)])


def hf_pieces(blocks: Sequence[RowBlock], shape: Sequence[int], itemsize: int, num_hf: int,
              canonical: Sequence[Segment]) -> list[list[Piece]]:
    """Each HF tensor's bytes in order, as pieces of the stored canonical tensor. ``canonical`` covers
    the canonical tensor's bytes, sorted by start (one segment for a converted checkpoint, several for
    chunks saved by training, e.g. TP row slices)."""
    width = row_bytes(shape, itemsize)
    out: list[list[Piece]] = [[] for _ in range(num_hf)]
    for b in sorted(blocks, key=lambda b: (b.hf, b.hf_row)):
        out[b.hf] += _slice(canonical, b.canonical_row * width, b.rows * width)
    return [merged(pieces) for pieces in out]


def _slice(segments: Sequence[Segment], start: int, nbytes: int) -> list[Piece]:
    """Bytes [start, start + nbytes) of a tensor covered by ``segments`` (sorted, gap-free)."""
    pieces = []
    i = max(0, bisect.bisect_right([s.start for s in segments], start) - 1)
    end = start + nbytes
    while start < end:
        segment = segments[i]
        skip = start - segment.start
        take = min(end, segment.start + segment.piece.nbytes) - start
        if skip < 0 or take <= 0:
            raise ValueError(f"segments do not cover byte {start} ({segments[i]})")
        pieces.append(segment.piece._replace(offset=segment.piece.offset + skip, nbytes=take))
        start += take
        i += 1
    return pieces


def contiguous_span(offsets: Sequence[int], lengths: Sequence[int], shape: Sequence[int]) -> tuple[int, int] | None:
    """(first element, element count) of the box [offsets, offsets + lengths) of a row-major array of
    ``shape`` when the box is one contiguous run of elements, else None: after the first axis the box
    does not take whole (length > 1), every axis must be taken whole."""
    start, partial = 0, False
    for offset, length, size in zip(offsets, lengths, shape):
        if partial and length != size:
            return None
        start = start * size + offset
        partial = partial or length > 1
    count = 1
    for length in lengths:
        count *= length
    return start, count


def copy_pieces(pieces: Sequence[Piece], dst_fd: int, dst_offset: int, dst_path: str) -> int:
    """Write the pieces back to back into ``dst_fd`` from ``dst_offset``; returns the bytes written."""
    for p in pieces:
        _copy_range(p, dst_fd, dst_offset, dst_path)
        dst_offset += p.nbytes
    return sum(p.nbytes for p in pieces)


def read_piece(piece: Piece) -> bytes | bytearray:
    """The piece's bytes, read into memory (for the few that are loaded rather than copied)."""
    if not isinstance(piece.fd, int):
        return piece.fd.read_range(piece.offset, piece.nbytes)
    if piece.fd == ZEROS_FD:
        return bytes(piece.nbytes)
    buffer = bytearray(piece.nbytes)
    view, done = memoryview(buffer), 0
    while done < piece.nbytes:
        n = os.preadv(piece.fd, [view[done:]], piece.offset + done)
        if not n:
            raise ConversionError(f"{piece.path}: file ends before byte {piece.offset + piece.nbytes}")
        done += n
    return buffer


def pwrite_all(fd: int, data, offset: int) -> int:
    """Write all of ``data`` (bytes-like) at ``offset`` of ``fd``; returns its length."""
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _copy_range(piece: Piece, dst_fd: int, dst_offset: int, dst_path: str) -> None:
    if not isinstance(piece.fd, int):
        piece.fd.write_range(piece.offset, piece.nbytes, dst_fd, dst_offset)
        return
    if piece.fd == ZEROS_FD:
        _write_zeros(piece.nbytes, dst_fd, dst_offset)
        return
    if not hasattr(os, "copy_file_range"):  # Linux only (the platform's call, not ours)
        _copy_buffered(piece, dst_fd, dst_offset, dst_path)
        return
    src, done = piece.offset, 0
    while done < piece.nbytes:
        try:
            n = os.copy_file_range(piece.fd, dst_fd, piece.nbytes - done, src + done, dst_offset + done)
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                raise
            _copy_buffered(piece._replace(offset=src + done, nbytes=piece.nbytes - done), dst_fd, dst_offset + done,
                           dst_path)
            return
        if not n:
            raise ConversionError(f"{piece.path}: file ends before byte {piece.offset + piece.nbytes}")
        done += n


def _copy_buffered(piece: Piece, dst_fd: int, dst_offset: int, dst_path: str) -> None:
    buffer = memoryview(bytearray(min(piece.nbytes, _BUFFER_BYTES)))
    done = 0
    while done < piece.nbytes:
        want = min(len(buffer), piece.nbytes - done)
        n = os.preadv(piece.fd, [buffer[:want]], piece.offset + done)
        if not n:
            raise ConversionError(f"{piece.path}: file ends before byte {piece.offset + piece.nbytes}")
        written = 0
        while written < n:
            written += os.pwrite(dst_fd, buffer[written:n], dst_offset + done + written)
        done += n


def _write_zeros(nbytes: int, dst_fd: int, dst_offset: int) -> None:
    """Explicit zero bytes (not a hole): the file's size and contents do not depend on the file system."""
    buffer = memoryview(bytes(min(nbytes, _BUFFER_BYTES)))
    done = 0
    while done < nbytes:
        done += os.pwrite(dst_fd, buffer[:min(len(buffer), nbytes - done)], dst_offset + done)
