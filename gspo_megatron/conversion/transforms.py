"""The tensor transforms shared by every family's table, each written once and two-way.

A transform turns the Hugging Face tensors of one table row into the one canonical Megatron tensor
(``to_megatron``) and back (``to_hf``); ``hf_shapes`` says which HF shapes a canonical shape implies, so
a checkpoint can be validated before anything is read. Round trips are exact: only reshapes, concats and
slices, never arithmetic, so HF -> Megatron -> HF returns the same bytes.

Every transform is a permutation of whole rows (slices along dim 0), and ``row_blocks`` states it as
such: the offline converters use it to copy byte ranges between files without loading tensors, the
tensor methods serve the live export and the paths that must load (casts, column-split chunks).

Expert renumbering (global <-> (EP rank, local)) is the other shared piece: the Transformer Engine name
translation in ``tables.py`` uses it for grouped experts, whose names carry the *local* expert number.
Layer renumbering (stage-local <-> global) lives in ``megatron/sharding.py``.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

Shape = tuple[int, ...]


class RowBlock(NamedTuple):
    """Rows [canonical_row, canonical_row + rows) of the canonical tensor are rows [hf_row, hf_row + rows)
    of HF tensor number ``hf``. A transform's blocks cover every row of both sides exactly once."""

    hf: int
    hf_row: int
    canonical_row: int
    rows: int


@dataclasses.dataclass(frozen=True)
class Identity:
    """One HF tensor is the canonical tensor."""

    def hf_shapes(self, canonical: Shape) -> list[Shape]:
        return [tuple(canonical)]

    def to_megatron(self, hf: Sequence[torch.Tensor]) -> torch.Tensor:
        (tensor,) = hf
        return tensor

    def to_hf(self, canonical: torch.Tensor) -> list[torch.Tensor]:
        return [canonical]

    def row_blocks(self, canonical: Shape) -> list[RowBlock]:
        return [RowBlock(0, 0, 0, canonical[0])]


@dataclasses.dataclass(frozen=True)
class FusedQKV:
    """HF q/k/v projections <-> Megatron's fused ``linear_qkv``, interleaved per KV group.

    With H query heads, G KV groups and head dim d, HF has q [H*d, ...], k [G*d, ...], v [G*d, ...]
    (query head i uses KV group i // (H/G)). Megatron's rows are, for each group g:
    [q heads g*H/G .. (g+1)*H/G - 1 (H/G*d rows); k_g (d rows); v_g (d rows)], so a TP split of dim 0
    keeps whole groups together. ``...`` is [hidden] for weights and nothing for biases.
    """

    heads: int
    groups: int
    head_dim: int

    def hf_shapes(self, canonical: Shape) -> list[Shape]:
        rest = tuple(canonical[1:])
        d = self.head_dim
        return [(self.heads * d, *rest), (self.groups * d, *rest), (self.groups * d, *rest)]

    def to_megatron(self, hf: Sequence[torch.Tensor]) -> torch.Tensor:
        q, k, v = hf
        g, d, rest = self.groups, self.head_dim, tuple(q.shape[1:])
        parts = [q.reshape(g, self.heads // g * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def to_hf(self, canonical: torch.Tensor) -> list[torch.Tensor]:
        g, d, rest = self.groups, self.head_dim, tuple(canonical.shape[1:])
        per_group = canonical.reshape(g, (self.heads // g + 2) * d, *rest)
        q, k, v = per_group.split([self.heads // g * d, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    def row_blocks(self, canonical: Shape) -> list[RowBlock]:
        """Group g: q rows [g*Q, (g+1)*Q), then k and v rows [g*d, (g+1)*d), at canonical rows from
        g*(Q + 2d), with Q = H/G*d query rows per group."""
        d, queries = self.head_dim, self.heads // self.groups * self.head_dim
        blocks = []
        for g in range(self.groups):
            start = g * (queries + 2 * d)
            blocks += [RowBlock(0, g * queries, start, queries), RowBlock(1, g * d, start + queries, d),
                       RowBlock(2, g * d, start + queries + d, d)]
        return blocks


@dataclasses.dataclass(frozen=True)
class FusedGateUp:
    """HF gate [F, h] and up [F, h] <-> Megatron's SwiGLU ``linear_fc1`` = [gate; up] ([2F, h]).

    Under TP the canonical tensor is split per half (sharding.py's "glu" split), not here.
    """

    def hf_shapes(self, canonical: Shape) -> list[Shape]:
        half = (canonical[0] // 2, *canonical[1:])
        return [half, half]

    def to_megatron(self, hf: Sequence[torch.Tensor]) -> torch.Tensor:
        gate, up = hf
        return torch.cat([gate, up], dim=0)

    def to_hf(self, canonical: torch.Tensor) -> list[torch.Tensor]:
        return [t.contiguous() for t in canonical.chunk(2, dim=0)]

    def row_blocks(self, canonical: Shape) -> list[RowBlock]:
        half = canonical[0] // 2
        return [RowBlock(0, 0, 0, half), RowBlock(1, 0, half, half)]


Transform = Identity | FusedQKV | FusedGateUp


# ---- renumbering ---------------------------------------------------------------------------------

