"""Per-token log-ratios and their per-sequence sums: the seam where context parallelism all-reduces.

GSPO's ratio s_i = exp((1/|y_i|) sum_t log(pi_theta / pi_old)) (Eq. 7) needs the sum over *all* tokens
of a sequence and its length before the exponent. Under context parallelism (CP) a sequence is split
across ranks, so a loss is computed in three steps:

    (a) ``sequence_sums(batch)``                  local segment sums   -> SequenceSums ([S] each)
    (*) ``reduce_sequence_sums(local)``           caller's all-reduce (SUM) over the CP group
    (b) ``gspo_loss_from_sums(total, ...)``       per-sequence sums    -> loss

``reduce_sequence_sums`` must all-reduce ``log_ratio`` with an autograd-aware SUM whose backward is
again a SUM all-reduce of the gradient (``torch.distributed.nn.functional.all_reduce``), and may use a
plain all-reduce for ``tokens`` and ``rollout_log_ratio``. Each CP rank then evaluates the same
per-sequence term; the losses weight it by ``share = local tokens / total tokens`` so that the CP ranks'
losses add up to the sequence's term once, and the backward all-reduce hands every rank the full
gradient d loss / d (sum of log-ratios). Without CP the reduce is the identity and ``share`` is 1.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from gspo_megatron.algorithms.layout import TokenBatch

# exp(20) = 4.85e8: the largest factor a ratio can reach, finite in float32 together with its gradient.
LOG_RATIO_LIMIT = 20.0
# Clamp on one token's log-ratio, so that a segment sum of finite but huge values (old log-probs of
# -3e38) cannot overflow to inf or give inf - inf; real log-ratios are far below this.
TOKEN_LOG_RATIO_LIMIT = 1e4


def masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N] float32 log pi_theta - log pi_old on response tokens, 0 elsewhere, clamped to +-TOKEN_LOG_RATIO_LIMIT.

    Differentiable in both arguments (the KL estimator differentiates the second). Masked positions
    are overwritten, not multiplied, so padding holding inf or NaN never reaches a value or gradient.
    """
    return _MaskedLogRatio.apply(logprobs, old_logprobs, mask)


class _MaskedLogRatio(torch.autograd.Function):
    """One fused op so that backward keeps a bool mask (N bytes) instead of a float copy of the
    difference (4N bytes), which ``torch.where(mask, (a - b).clamp(...), 0)`` would save."""

    @staticmethod
    def forward(ctx, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        diff = logprobs.to(torch.float32) - old_logprobs.to(torch.float32)
        keep = diff.ge(-TOKEN_LOG_RATIO_LIMIT)  # False for NaN, so a NaN in padding gets no gradient
        keep &= diff.le(TOKEN_LOG_RATIO_LIMIT)
        keep &= mask
        diff.clamp_(-TOKEN_LOG_RATIO_LIMIT, TOKEN_LOG_RATIO_LIMIT).masked_fill_(~mask, 0.0)
        ctx.save_for_backward(keep)
        ctx.dtypes = (logprobs.dtype, old_logprobs.dtype)
        return diff

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        grad_new = grad_old = None
        if ctx.needs_input_grad[0]:
            grad_new = torch.where(keep, grad, 0.0).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            grad_old = torch.where(keep, -grad, 0.0).to(ctx.dtypes[1])
        return grad_new, grad_old, None


@dataclass(frozen=True)
class SequenceSums:
    """Per-sequence sums over response tokens; everything a CP group all-reduces (SUM).

    log_ratio:         [S] sum_t (log pi_theta - log pi_old), carries the gradient;
    tokens:            [S] float32 number of response tokens |y_i|;
    rollout_log_ratio: [S] sum_t (log pi_old - log pi_rollout), no gradient; only when the batch has
                       rollout log-probs (sequence-level TIS, mismatch metric).
    """

    log_ratio: Tensor
    tokens: Tensor
    rollout_log_ratio: Tensor | None = None

    def mean_log_ratio(self) -> Tensor:
        """[S] (1/|y_i|) sum_t log-ratio clamped to +-LOG_RATIO_LIMIT: log s_i of Eq. 7 (0 for empty sequences)."""
        return (self.log_ratio / self.tokens.clamp(min=1.0)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


ReduceSequenceSums = Callable[[SequenceSums], SequenceSums]


def sequence_sums(batch: TokenBatch, token_log_ratio: Tensor | None = None) -> SequenceSums:
    """Step (a): segment sums of one rank's tokens. ``token_log_ratio`` ([N]) if already computed."""
    if token_log_ratio is None:
        token_log_ratio = masked_log_ratio(batch.logprobs, batch.old_logprobs, batch.mask)
    seg = batch.segments
    rollout = None
    if batch.rollout_logprobs is not None:
        with torch.no_grad():
            rollout = seg.sum(masked_log_ratio(batch.old_logprobs, batch.rollout_logprobs, batch.mask))
    return SequenceSums(seg.sum(token_log_ratio), seg.sum(batch.mask.to(torch.float32)), rollout)


@dataclass(frozen=True)
class SequenceContext:
    """What every loss reads: token log-ratios and the per-sequence sums before and after the CP reduce.

    token_log_ratio: [N] ``masked_log_ratio`` of this rank's tokens (carries the gradient);
    local:           [S] sums over this rank's tokens;
    total:           [S] sums over the whole sequence (``local`` after ``reduce_sequence_sums``).
    """

    token_log_ratio: Tensor
    local: SequenceSums
    total: SequenceSums

    def share(self) -> Tensor:
        """[S] this rank's fraction of each sequence's tokens (1 without CP, 0 for an empty sequence):
        the weight of a per-sequence term that every CP rank evaluates."""
        return self.local.tokens / self.total.tokens.clamp(min=1.0)


def sequence_context(batch: TokenBatch, reduce_sequence_sums: ReduceSequenceSums | None = None) -> SequenceContext:
    """Steps (a) and (*): token log-ratios, local sums and, through the caller's reduce, total sums."""
    token_log_ratio = masked_log_ratio(batch.logprobs, batch.old_logprobs, batch.mask)
    local = sequence_sums(batch, token_log_ratio)
    total = local if reduce_sequence_sums is None else reduce_sequence_sums(local)
    if total.log_ratio.shape != local.log_ratio.shape or total.tokens.shape != local.tokens.shape:
        raise ValueError("reduce_sequence_sums: must return SequenceSums of the same shapes ([S]) it was given")
    return SequenceContext(token_log_ratio, local, total)


def sequence_tis_weights(total: SequenceSums, cap: float) -> Tensor:
    """[S] min(exp((1/|y_i|) sum_t log(pi_old / pi_rollout)), cap), detached; length-normalised like s_i."""
    if total.rollout_log_ratio is None:
        raise ValueError("tis_mode=sequence: the batch has no rollout_logprobs (the inference engine's log-probs)")
    mean = replace(total, log_ratio=total.rollout_log_ratio).mean_log_ratio()
    return torch.exp(mean).clamp(max=cap).detach()


def token_tis_weights(batch: TokenBatch, cap: float) -> Tensor:
    """[N] min(pi_old(y_t) / pi_rollout(y_t), cap) on response tokens (1 elsewhere), detached."""
    if batch.rollout_logprobs is None:
        raise ValueError("tis_mode=token: the batch has no rollout_logprobs (the inference engine's log-probs)")
    with torch.no_grad():
        log_w = masked_log_ratio(batch.old_logprobs, batch.rollout_logprobs, batch.mask)
        return torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).clamp(max=cap)
