"""Token layouts: which sequence each token belongs to, and the micro-batch a loss function reads.

Every loss works on a flat token stream of N tokens from S sequences:

* **packed** (THD): the sequences are concatenated into one 1-D stream and ``cu_seqlens`` ([S + 1],
  cumulative lengths starting at 0) or per-token sequence ids say where each one starts;
* **padded** ([B, T] with a mask): flattened row-major to N = B * T tokens with S = B.

A ``Segments`` object holds the per-token sequence id ([N] int64) and S; per-sequence reductions are one
``index_add`` (a segment sum), never a Python loop over sequences, so their cost does not depend on S.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Loss code that needs per-token scratch (metrics, the fused losses) makes it one chunk at a time: a
# chunk holds at most 1 / SCRATCH_CHUNKS of the stream (and at least MIN_CHUNK_TOKENS tokens), so a
# few temporaries per chunk stay a small fraction of one float32 token tensor. The Python loop runs
# over at most SCRATCH_CHUNKS chunks, never over sequences.
SCRATCH_CHUNKS = 8
MIN_CHUNK_TOKENS = 8192


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The precision of the loss maths: float32 (also for bfloat16 / float16 inputs), float64 when an
    input is float64 (double-precision checks such as ``torch.autograd.gradcheck``)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def token_chunks(num_tokens: int) -> list[slice]:
    """Contiguous slices covering 0 .. num_tokens - 1 (none when it is 0), see SCRATCH_CHUNKS."""
    size = max(MIN_CHUNK_TOKENS, -(-num_tokens // SCRATCH_CHUNKS), 1)
    return [slice(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]


@dataclass(frozen=True)
class Segments:
    """Sequence membership of a flat token stream.

    seq_ids:  [N] int64, the sequence (0 .. num_seqs - 1) each token belongs to; need not be sorted.
    num_seqs: S, the number of sequences (some may own no response tokens at all).
    """

    seq_ids: Tensor
    num_seqs: int

    def __post_init__(self) -> None:
        if self.seq_ids.dim() != 1 or self.seq_ids.dtype != torch.int64:
            raise ValueError(
                f"Segments.seq_ids: expected a 1-D int64 tensor, got {self.seq_ids.dtype} of shape {tuple(self.seq_ids.shape)}"
            )
        if self.num_seqs < 0:
            raise ValueError(f"Segments.num_seqs: must be >= 0, got {self.num_seqs}")

    @property
    def num_tokens(self) -> int:
        return self.seq_ids.numel()

    @staticmethod
    def from_cu_seqlens(cu_seqlens: Tensor, num_tokens: int | None = None) -> "Segments":
        """Packed layout. cu_seqlens: [S + 1] cumulative lengths, cu_seqlens[0] == 0, cu_seqlens[-1] == N.

        ``num_tokens`` (N) avoids a device-to-host read of ``cu_seqlens[-1]`` when the caller knows it.
        """
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor [S + 1], got shape {tuple(cu_seqlens.shape)}")
        num_seqs = cu_seqlens.numel() - 1
        total = int(cu_seqlens[-1]) if num_tokens is None else num_tokens
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        ids = torch.arange(num_seqs, device=cu_seqlens.device)
        return Segments(torch.repeat_interleave(ids, lengths, output_size=total), num_seqs)

    @staticmethod
    def from_padded(batch_size: int, seq_len: int, device: torch.device | str = "cpu") -> "Segments":
        """Padded layout [B, T] flattened row-major: token b * T + t belongs to sequence b."""
        ids = torch.arange(batch_size, device=device)
        return Segments(ids.repeat_interleave(seq_len), batch_size)

    def sum(self, values: Tensor) -> Tensor:
        """Segment sum: [N] -> [S] (differentiable; backward is a gather)."""
        out = torch.zeros(self.num_seqs, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.seq_ids, values)

    def count(self, mask: Tensor) -> Tensor:
        """[S] float32 number of True entries of a bool [N] ``mask`` per sequence, converted chunk by chunk."""
        out = torch.zeros(self.num_seqs, dtype=torch.float32, device=mask.device)
        flat = mask.reshape(-1)
        for part in token_chunks(self.num_tokens):
            out.index_add_(0, self.seq_ids[part], flat[part].to(torch.float32))
        return out

    def expand(self, per_seq: Tensor) -> Tensor:
        """Broadcast a per-sequence value to its tokens: [S] -> [N] (backward is a segment sum)."""
        return per_seq.index_select(0, self.seq_ids)

    def amin(self, values: Tensor) -> Tensor:
        """Segment minimum [N] -> [S]; +inf for a sequence without tokens (the identity of min)."""
        out = torch.full((self.num_seqs,), float("inf"), dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, self.seq_ids, values, reduce="amin", include_self=True)

    def amax(self, values: Tensor) -> Tensor:
        """Segment maximum [N] -> [S]; -inf for a sequence without tokens (the identity of max)."""
        out = torch.full((self.num_seqs,), float("-inf"), dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, self.seq_ids, values, reduce="amax", include_self=True)


@dataclass(frozen=True)
class LossNormalisers:
    """Counts over the **whole mini-batch** (every micro-batch, every data-parallel rank), computed once.

    num_seqs:   sequences with at least one response token;
    num_tokens: response tokens.
    Every loss divides by these, not by the counts of its own micro-batch, so the sum of the micro-batch
    losses equals the loss of the whole mini-batch and splitting never changes a gradient. A zero count
    (an empty mini-batch) is treated as 1, which gives a zero loss.
    """

    num_seqs: float
    num_tokens: float

    def __add__(self, other: "LossNormalisers") -> "LossNormalisers":
        return LossNormalisers(self.num_seqs + other.num_seqs, self.num_tokens + other.num_tokens)


def count_normalisers(mask: Tensor, segments: Segments) -> LossNormalisers:
    """Local counts of one micro-batch (sum them over micro-batches and all-reduce over DP ranks).

    Count on the unsplit sequences: a context-parallel chunk holds part of a sequence, so counting
    sequences per CP chunk would count a sequence once per chunk.
    """
    tokens = segments.count(mask)
    return LossNormalisers(num_seqs=float((tokens > 0).sum()), num_tokens=float(tokens.sum()))


@dataclass(frozen=True)
class TokenBatch:
    """One micro-batch of responses in the flat layout (N tokens, S sequences).

    logprobs:         [N] log pi_theta(y_t | x, y_<t), float32, carries the gradient;
    old_logprobs:     [N] log pi_old (the policy that sampled), no gradient;
    mask:             [N] bool, True on response tokens that count (not prompt, padding, tool output);
    segments:         sequence id of each token;
    advantages:       [S] one advantage per sequence (GSPO, GRPO) -- or
    token_advantages: [N] one per token (GSPO-token, GRPO); exactly one of the two is given;
    ref_logprobs:     [N] log pi_ref of a frozen reference model (KL term / metric), optional;
    teacher_logprobs: [N] log pi_teacher of a distillation teacher (``distill_penalty``), optional;
    entropy:          [N] per-token entropy of pi_theta, carries the gradient (entropy bonus), optional;
    rollout_logprobs: [N] log-probs the inference engine reported (mismatch metric, TIS), optional.

    Values at masked positions are never read (``torch.where``), so padding may hold anything.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    mask: Tensor
    segments: Segments
    advantages: Tensor | None = None
    token_advantages: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None

    def __post_init__(self) -> None:
        n = self.segments.num_tokens
        for name in ("logprobs", "old_logprobs", "mask", "token_advantages", "ref_logprobs", "entropy", "rollout_logprobs",
                     "teacher_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (n,):
                raise ValueError(f"TokenBatch.{name}: expected shape ({n},) like segments.seq_ids, got {tuple(value.shape)}")
        if self.mask.dtype != torch.bool:
            raise ValueError(f"TokenBatch.mask: expected a bool tensor, got {self.mask.dtype}")
        if (self.advantages is None) == (self.token_advantages is None):
            raise ValueError("TokenBatch.advantages: give exactly one of advantages [S] and token_advantages [N]")
        if self.advantages is not None and tuple(self.advantages.shape) != (self.segments.num_seqs,):
            raise ValueError(
                f"TokenBatch.advantages: expected shape ({self.segments.num_seqs},), one per sequence, got {tuple(self.advantages.shape)}"
            )

    def token_advantage(self) -> Tensor:
        """[N] the advantage of each token (per-sequence advantages broadcast)."""
        if self.token_advantages is not None:
            return self.token_advantages
        return self.segments.expand(self.advantages)


def packed_batch(
    logprobs: Tensor,
    old_logprobs: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    segments: Segments | None = None,
    advantages: Tensor | None = None,
    token_advantages: Tensor | None = None,
    mask: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
) -> TokenBatch:
    """Packed layout: [N] token tensors with ``cu_seqlens`` [S + 1] or prebuilt ``segments``.

    ``mask`` defaults to all tokens (a stream that holds only response tokens).
    """
    if (cu_seqlens is None) == (segments is None):
        raise ValueError("packed_batch: give exactly one of cu_seqlens and segments")
    if segments is None:
        segments = Segments.from_cu_seqlens(cu_seqlens, logprobs.numel())
    if mask is None:
        mask = torch.ones(logprobs.shape, dtype=torch.bool, device=logprobs.device)
    return TokenBatch(
        logprobs, old_logprobs, mask, segments, advantages, token_advantages, ref_logprobs, entropy, rollout_logprobs,
        teacher_logprobs,
    )


def padded_batch(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
) -> TokenBatch:
    """Padded layout: [B, T] token tensors, ``mask`` [B, T]; ``advantages`` [B] (per sequence) or [B, T].

    Flattening is a view for contiguous inputs, so no token tensor is copied.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"padded_batch.logprobs: expected [B, T], got shape {tuple(logprobs.shape)}")
    batch_size, seq_len = logprobs.shape
    segments = Segments.from_padded(batch_size, seq_len, logprobs.device)
    per_token = advantages.dim() == 2

    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.reshape(-1)

    return TokenBatch(
        flat(logprobs),
        flat(old_logprobs),
        flat(mask),
        segments,
        advantages=None if per_token else advantages,
        token_advantages=flat(advantages) if per_token else None,
        ref_logprobs=flat(ref_logprobs),
        entropy=flat(entropy),
        rollout_logprobs=flat(rollout_logprobs),
        teacher_logprobs=flat(teacher_logprobs),
    )
