"""Released Hugging Face checkpoints seen as the tensors the weight tables name (``ReleaseView``).

Releases store the tables' tensors (bf16/fp32, one tensor per expert, ``models/weights.py``) in other forms:
- **block-scaled FP8** (DeepSeek-V3/R1, Kimi-K2, Qwen3 FP8; ``quantization_config`` ``quant_method: fp8``
  with ``weight_block_size``): tensor ``X`` stored as ``float8_e4m3fn`` beside its fp32 ``X_scale_inv``.
  It reads as ``X`` dequantized to the config's dtype (``fp8.dequantize``), computed block row by block row
  while it is copied (``DequantizedFP8``, a ``byte_ranges.Computed`` source), so memory stays bounded.
- **fused experts** (transformers 5, ``weights.Stacked``): the per-expert tensors are row blocks of one
  3-D tensor, so each is a byte range of it (of its dequantized bytes when it is FP8 too).
- **renamed tensors** (``weights.Renamed``, e.g. Mixtral's router under transformers 5's ``mlp``).
The fused and renamed forms are data, each family's ``stored_forms``; FP8 applies to whatever tensor has a
scale. A view exposes what ``HFCheckpoint`` does (``tensors``, ``piece``, ``location``, ``directory``,
``index``), so the converters run on it unchanged; ``formats`` says which forms were found.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Iterator, Mapping

import torch

from gspo_megatron.conversion import fp8
from gspo_megatron.conversion.byte_ranges import Piece, pwrite_all, read_piece
from gspo_megatron.conversion.errors import ConversionError, name_list
from gspo_megatron.conversion.safetensors_io import HFCheckpoint, StoredTensor, TensorSpec, read_exact
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.models import registry
from gspo_megatron.models.weights import Renamed, Stacked

WINDOW_ELEMENTS = 2**21  # weights dequantized at a time (float64 intermediates: ~50 MB)
CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class LogicalTensor:
    """One tensor the tables name: its spec, its bytes (``piece``, possibly computed), the file and stored
    tensor they come from (for errors and read order)."""

    spec: TensorSpec
    path: Path
    piece: Piece
    stored: str
    stored_offset: int


class DequantizedFP8:
    """The bytes of a block-FP8 tensor [..., R, C] dequantized to ``dtype`` (row-major, as if stored), computed
    for the rows a copy asks for, at most WINDOW_ELEMENTS weights at a time."""

    def __init__(self, weight: StoredTensor, scale: StoredTensor, fds: Mapping[Path, int], block: tuple[int, int],
                 dtype: torch.dtype):
        self.weight, self.scale, self.block, self.dtype = weight, scale, block, dtype
        self._weight_fd, self._scale_fd = fds[weight.path], fds[scale.path]
        self.rows, self.cols = weight.spec.shape[-2:]
        self.row_bytes = self.cols * dtype.itemsize

    def _windows(self, offset: int, nbytes: int) -> Iterator[tuple[int, int, int]]:
        """(matrix, first row, rows) of each window covering output bytes [offset, offset + nbytes)."""
        if offset % self.row_bytes or nbytes % self.row_bytes:
            raise ConversionError(f"{self.weight.path}: {self.weight.spec.name}: a read of bytes [{offset}, "
                                  f"{offset + nbytes}) does not take whole rows of the dequantized tensor")
        b0 = self.block[0]
        step = max(b0, WINDOW_ELEMENTS // self.cols // b0 * b0)
        row, end = offset // self.row_bytes, (offset + nbytes) // self.row_bytes
        while row < end:
            matrix, first = divmod(row, self.rows)
            stop = min(end, (matrix + 1) * self.rows, matrix * self.rows + first // b0 * b0 + step)
            yield matrix, first, stop - row
            row = stop

    def _dequantized(self, matrix: int, first: int, rows: int) -> torch.Tensor:
        b0, b1 = self.block
        q = torch.empty(rows * self.cols, dtype=torch.uint8)
        read_exact(self._weight_fd, self.weight.path, self.weight.offset + (matrix * self.rows + first) * self.cols, q)
        block_rows, block_cols = math.ceil(self.rows / b0), math.ceil(self.cols / b1)
        s_first, s_end = first // b0, math.ceil((first + rows) / b0)
        s = torch.empty((s_end - s_first) * block_cols, dtype=torch.float32)
        read_exact(self._scale_fd, self.scale.path,
                   self.scale.offset + (matrix * block_rows + s_first) * block_cols * 4, s.view(torch.uint8))
        return fp8.dequantize(q.view(fp8.FP8).reshape(rows, self.cols), s.reshape(s_end - s_first, block_cols),
                              self.block, self.dtype, first_row=first)

    def write_range(self, offset: int, nbytes: int, dst_fd: int, dst_offset: int) -> None:
        for window in self._windows(offset, nbytes):
            dst_offset += pwrite_all(dst_fd, self._dequantized(*window).reshape(-1).view(torch.uint8).numpy(),
                                     dst_offset)

    def read_range(self, offset: int, nbytes: int) -> bytearray:
        out = bytearray()
        for window in self._windows(offset, nbytes):
            out += self._dequantized(*window).reshape(-1).view(torch.uint8).numpy().tobytes()
        return out


def check_finite_scales(scale: StoredTensor, fd: int) -> None:
    """A NaN or inf block scale is refused naming the tensor and the block, before anything is written (it
    would dequantize into NaN / inf weights without a word). Scales are 1/(b0*b1) of the weights' count."""
    values = torch.empty(scale.spec.shape, dtype=torch.float32)
    read_exact(fd, scale.path, scale.offset, values.view(-1).view(torch.uint8))
    finite = torch.isfinite(values)
    if not finite.all():
        at = [int(i) for i in (~finite).nonzero()[0]]
        raise ConversionError(f"{scale.path}: {scale.spec.name}{at}: {float(values[tuple(at)])} is not finite "
                              f"(the weights would dequantize to NaN / inf)")


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{layer}"), r"(?P<layer>\d+)") + "$")


def _fill(template: str, layer: str, expert: int | None = None) -> str:
    return template.replace("{layer}", layer).replace("{expert}", str(expert))


def fp8_settings(hf_config: Mapping, source: str) -> tuple[tuple[int, int], torch.dtype] | None:
    """(block, dequantized dtype) of a block-FP8 ``config.json``, None without ``quantization_config``;
    any other quantization is an error naming the field."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != "fp8":
        raise ConversionError(f"{source}: quantization_config.quant_method: unsupported {qc.get('quant_method')!r} "
                              f"(supported: 'fp8' with weight_block_size)")
    block = qc.get("weight_block_size")
    if not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ConversionError(f"{source}: quantization_config.weight_block_size: expected two positive integers "
                              f"(block-scaled FP8), got {block!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConversionError(f"{source}: quantization_config.activation_scheme: unsupported "
                              f"{qc.get('activation_scheme')!r} (supported: 'dynamic', no stored input scales)")
    name = hf_config.get("dtype", hf_config.get("torch_dtype", "bfloat16"))
    if name not in CONFIG_DTYPES:
        raise ConversionError(f"{source}: dtype: {name!r} is not a dtype FP8 weights dequantize to "
                              f"(supported: {sorted(CONFIG_DTYPES)})")
    return (block[0], block[1]), CONFIG_DTYPES[name]


def exported_as_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors an FP8 export quantizes, as the DeepSeek-V3 release does: the matrices of the linear
    projections (``*_proj.weight``: attention, dense, shared and routed experts, MTP's ``eh_proj``); the
    embedding, output layer, norms, router and expert bias stay in the model's dtype."""
    return name.endswith("_proj.weight") and len(shape) == 2


def fp8_quantization_config(block: tuple[int, int]) -> dict:
    """config.json's ``quantization_config`` of an FP8 export (what ``fp8_settings`` reads back)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


class ReleaseView:
    """The tensors of ``hf`` as the weight tables of ``config`` name them (module docstring)."""

    def __init__(self, hf: HFCheckpoint, config: ModelConfig, hf_config: Mapping | None):
        self.directory, self.index = hf.directory, hf.index
        self.formats: list[str] = []
        source = str(hf.directory / "config.json")
        settings = fp8_settings(hf_config or {}, source)
        self.fp8_block = settings[0] if settings else None
        self.tensors = self._dequantized(hf, settings, source)
        for form in registry.FAMILIES[config.architecture].stored_forms:
            self._apply(form, config)

    def _dequantized(self, hf: HFCheckpoint, settings, source: str) -> dict[str, LogicalTensor]:
        quantized = {name for name, t in hf.tensors.items() if t.spec.dtype == fp8.FP8}
        if quantized and settings is None:
            raise ConversionError(f"{source}: quantization_config: missing, but the checkpoint holds float8_e4m3fn "
                                  f"tensors: {name_list(quantized)}")
        scales = {name + fp8.SCALE_SUFFIX for name in quantized}
        out: dict[str, LogicalTensor] = {}
        for name, stored in hf.tensors.items():
            if name in scales:
                continue
            if name not in quantized:
                out[name] = LogicalTensor(stored.spec, stored.path, hf.piece(name), name, stored.offset)
                continue
            block, dtype = settings
            scale = hf.tensors.get(name + fp8.SCALE_SUFFIX)
            expected = fp8.scale_shape(stored.spec.shape, block)
            if scale is None or len(stored.spec.shape) < 2:
                raise ConversionError(f"{stored.path}: {name}: a float8_e4m3fn tensor needs its block scales "
                                      f"{name}{fp8.SCALE_SUFFIX} (and at least 2 dimensions)")
            if scale.spec.dtype != torch.float32 or scale.spec.shape != expected:
                raise ConversionError(f"{scale.path}: {scale.spec.name}: {list(scale.spec.shape)} {scale.spec.dtype}, "
                                      f"expected {list(expected)} torch.float32 for {name} "
                                      f"{list(stored.spec.shape)} in {block[0]}x{block[1]} blocks")
            check_finite_scales(scale, hf.fds[scale.path])
            spec = TensorSpec(name, stored.spec.shape, dtype)
            computed = DequantizedFP8(stored, scale, hf.fds, block, dtype)
            out[name] = LogicalTensor(spec, stored.path, Piece(computed, 0, spec.nbytes, str(stored.path)), name,
                                      stored.offset)
        if quantized:
            self.formats.append(f"fp8-block-{settings[0][0]}x{settings[0][1]}")
        return out

    def _apply(self, form: Stacked | Renamed, config: ModelConfig) -> None:
        pattern = _pattern(form.stored)
        matched = [(name, m.group("layer")) for name in list(self.tensors) if (m := pattern.match(name))]
        for name, layer in matched:
            tensor = self.tensors.pop(name)
            if isinstance(form, Renamed):
                self._add(_fill(form.name, layer), tensor, tensor.spec.shape, 0)
                continue
            shape, parts = tensor.spec.shape, len(form.parts)
            if len(shape) != 3 or shape[0] != config.num_experts or shape[1] % parts:
                raise ConversionError(f"{tensor.path}: {name}: shape {list(shape)}, expected [num_experts="
                                      f"{config.num_experts}, {parts} x rows, cols] (fused experts)")
            rows = shape[1] // parts
            for expert in range(shape[0]):
                for j, part in enumerate(form.parts):
                    self._add(_fill(part, layer, expert), tensor, (rows, shape[2]), (expert * parts + j) * rows)
        if matched:
            kind = "fused-experts" if isinstance(form, Stacked) else "renamed"
            if kind not in self.formats:
                self.formats.append(kind)

    def _add(self, name: str, source: LogicalTensor, shape: tuple[int, ...], first_row: int) -> None:
        if name in self.tensors:
            raise ConversionError(f"{self.directory}: {name} is stored both as itself and inside {source.stored}")
        spec = TensorSpec(name, tuple(shape), source.spec.dtype)
        offset = source.piece.offset + first_row * shape[-1] * spec.dtype.itemsize
        self.tensors[name] = LogicalTensor(spec, source.path, source.piece._replace(offset=offset, nbytes=spec.nbytes),
                                           source.stored, source.stored_offset)

    def piece(self, name: str) -> Piece:
        return self.tensors[name].piece

    def location(self, name: str) -> tuple[str, int, int]:
        """(file name, stored offset, offset inside it): sort by it to read each file front to back."""
        tensor = self.tensors[name]
        return tensor.path.name, tensor.stored_offset, tensor.piece.offset

    def read(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        data = bytearray(read_piece(tensor.piece))
        return torch.frombuffer(data, dtype=tensor.spec.dtype).reshape(tensor.spec.shape)
