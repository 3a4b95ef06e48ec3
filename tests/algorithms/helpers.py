"""Shared builders for the algorithm tests (imported by name: tests/algorithms is on sys.path)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_megatron.algorithms import LossNormalisers, Segments, TokenBatch, count_normalisers, packed_batch


@dataclass
class Raw:
    """Packed tensors of a random batch; ``logprobs`` is a leaf that requires grad."""

    lengths: list[int]
    logprobs: Tensor
    old: Tensor
    advantages: Tensor
    token_advantages: Tensor
    ref: Tensor
    entropy: Tensor
    rollout: Tensor
    mask: Tensor

    @property
    def cu_seqlens(self) -> Tensor:
        return torch.tensor([0] + list(torch.tensor(self.lengths).cumsum(0).tolist()))

    def batch(self, *, per_token: bool = False, extras: bool = True) -> TokenBatch:
        return packed_batch(
            self.logprobs,
            self.old,
            cu_seqlens=self.cu_seqlens,
            advantages=None if per_token else self.advantages,
            token_advantages=self.token_advantages if per_token else None,
            mask=self.mask,
            ref_logprobs=self.ref if extras else None,
            entropy=self.entropy if extras else None,
            rollout_logprobs=self.rollout if extras else None,
        )

    def normalisers(self) -> LossNormalisers:
        return count_normalisers(self.mask, Segments.from_cu_seqlens(self.cu_seqlens))


def random_raw(lengths: list[int], *, seed: int = 0, scale: float = 1e-3, mask_frac: float = 0.0) -> Raw:
    """Log-ratios ~ N(0, scale); a ``mask_frac`` of tokens masked out (prompt / tool tokens)."""
    gen = torch.Generator().manual_seed(seed)
    n, s = sum(lengths), len(lengths)
    old = -torch.rand(n, generator=gen) * 4
    new = (old + scale * torch.randn(n, generator=gen)).requires_grad_(True)
    entropy = torch.rand(n, generator=gen).requires_grad_(True)
    return Raw(
        lengths=lengths,
        logprobs=new,
        old=old,
        advantages=torch.randn(s, generator=gen),
        token_advantages=torch.randn(n, generator=gen),
        ref=old + 0.05 * torch.randn(n, generator=gen),
        entropy=entropy,
        rollout=old + 0.01 * torch.randn(n, generator=gen),
        mask=torch.rand(n, generator=gen) >= mask_frac,
    )


def grad_of(loss: Tensor, *leaves: Tensor) -> list[Tensor]:
    return [g if g is not None else torch.zeros_like(x) for g, x in zip(torch.autograd.grad(loss, leaves, allow_unused=True), leaves)]
