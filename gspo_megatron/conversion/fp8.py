"""Block-scaled FP8 weights as released (DeepSeek-V3/R1, Kimi-K2, Qwen3 FP8): the arithmetic.

A weight W [..., R, C] is stored as ``q`` (``float8_e4m3fn``, same shape) and ``s`` = ``weight_scale_inv``
(fp32, [..., ceil(R / b0), ceil(C / b1)], b0 x b1 = ``quantization_config.weight_block_size``, 128 x 128 in
every release), with W[i, j] = q[i, j] * s[i // b0, j // b1]: each block of the matrix times its own scale.
The last block row / column is partial when R or C is not a multiple of the block.

Dequantization is exact up to one rounding: an e4m3 value has 4 significant bits and an fp32 scale 24, so
their product is exact in float64 (53 bits), and it is rounded once, to nearest even, to the target dtype.
torch converts float64 to bf16 / fp16 through fp32 (two roundings), so the product goes to fp32 with
round-to-odd first (``_to_float32_odd``), after which the RNE rounding to a format of <= 22 significant bits is
the correct one. DeepSeek's reference kernel multiplies in fp32 and rounds to bf16, which rounds twice and
differs from this in the last bf16 bit for a few products in a million.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_SUFFIX = "_scale_inv"  # "<name>_scale_inv" holds the scales of tensor "<name>" (weight -> weight_scale_inv)


def scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    """[..., R, C] -> [..., ceil(R / b0), ceil(C / b1)]: one scale per (possibly partial) block."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., ceil(rows / b0), ceil(cols / b1)] -> [..., rows, cols]: every element gets its block's scale."""
    full = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.bfloat16, first_row: int = 0) -> torch.Tensor:
    """W = q * s per block (module docstring): ``weight`` [..., R, C] fp8, ``scale_inv`` [..., ceil(R/b0),
    ceil(C/b1)] -> [..., R, C] in ``dtype``, correctly rounded. With ``first_row``, ``weight`` is rows
    [first_row, first_row + R) of a larger matrix and ``scale_inv`` the scale rows of the blocks they touch."""
    if weight.dtype != FP8:
        raise ValueError(f"dequantize: weight is {weight.dtype}, expected {FP8}")
    rows, cols = weight.shape[-2:]
    skip = first_row % block[0]
    expected = scale_shape((*weight.shape[:-2], skip + rows, cols), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"dequantize: scales {list(scale_inv.shape)} for weight rows [{first_row}, "
                         f"{first_row + rows}) x {cols} in {block[0]}x{block[1]} blocks (expected {list(expected)})")
    scales = expand_scales(scale_inv.to(torch.float64), skip + rows, cols, block)[..., skip:, :]
    exact = weight.to(torch.float64) * scales
    if dtype in (torch.float64, torch.float32):
        return exact.to(dtype)  # one RNE rounding (or none)
    return _to_float32_odd(exact).to(dtype)


def _to_float32_odd(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded to odd: truncate towards zero, and set the last bit when inexact. A later
    RNE rounding to a narrower format (bf16, fp16) then equals the RNE rounding of ``x`` itself."""
    nearest = x.to(torch.float32)
    overshot = nearest.to(torch.float64).abs() > x.abs()
    truncated = torch.where(overshot, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    inexact = truncated.to(torch.float64) != x
    bits = truncated.view(torch.int32)
    return torch.where(inexact, bits | 1, bits).view(torch.float32)


def quantize(tensor: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The release scheme's inverse: per block s = amax(|W|) / 448 (1 for an all-zero block) and
    q = round_e4m3(W / s), so that the block's largest value maps to e4m3's largest. Returns (q, s) with
    the shapes ``dequantize`` takes. W / s is computed in float64 and rounded once to e4m3."""
    *lead, rows, cols = tensor.shape
    b0, b1 = block
    pad_r, pad_c = -rows % b0, -cols % b1
    wide = torch.nn.functional.pad(tensor.to(torch.float64), (0, pad_c, 0, pad_r))
    blocks = wide.reshape(*lead, (rows + pad_r) // b0, b0, (cols + pad_c) // b1, b1)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.float32)
    q = tensor.to(torch.float64) / expand_scales(scale.to(torch.float64), rows, cols, block)
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
