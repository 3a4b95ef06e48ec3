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

from gspo_megatron.algorithms.layout import TokenBatch, compute_dtype, token_chunks

# exp(20) = 4.85e8: the largest factor a ratio can reach, finite in float32 together with its gradient.
LOG_RATIO_LIMIT = 20.0
# Clamp on one token's log-ratio, so that a segment sum of finite but huge values (old log-probs of
# -3e38) cannot overflow to inf or give inf - inf; real log-ratios are far below this.
TOKEN_LOG_RATIO_LIMIT = 1e4


def masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N] log pi_theta - log pi_old on response tokens, 0 elsewhere, clamped to +-TOKEN_LOG_RATIO_LIMIT;
    float32 (float64 if an input is, see ``layout.compute_dtype``).

    Differentiable in both arguments (the KL estimator differentiates the second). Masked positions
    are overwritten, not multiplied, so padding holding inf or NaN never reaches a value or gradient.
    """
    return _MaskedLogRatio.apply(logprobs, old_logprobs, mask)


def log_ratio_values(a: Tensor, b: Tensor, mask: Tensor, *, with_keep: bool = False) -> tuple[Tensor, Tensor | None]:
    """The value of ``masked_log_ratio(a, b, mask)`` without autograd, for whole tensors or chunks.

    With ``with_keep`` also the bool mask where d value / d a = 1 (and d / d b = -1): on the mask, within
    the clamp, not NaN. Elsewhere the derivative is 0.
    """
    dtype = compute_dtype(a, b)
    diff = a.to(dtype) - b.to(dtype)
    keep = None
    if with_keep:
        keep = diff.ge(-TOKEN_LOG_RATIO_LIMIT)  # False for NaN, so a NaN in padding gets no gradient
        keep &= diff.le(TOKEN_LOG_RATIO_LIMIT)
        keep &= mask
    diff.clamp_(-TOKEN_LOG_RATIO_LIMIT, TOKEN_LOG_RATIO_LIMIT).masked_fill_(~mask, 0.0)
    return diff, keep


class _MaskedLogRatio(torch.autograd.Function):
    """One fused op so that backward keeps a bool mask (N bytes) instead of a float copy of the
    difference (4N bytes), which ``torch.where(mask, (a - b).clamp(...), 0)`` would save."""

    @staticmethod
    def forward(ctx, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        diff, keep = log_ratio_values(logprobs, old_logprobs, mask, with_keep=True)
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
    """Step (a): segment sums of one rank's tokens.

    Without ``token_log_ratio`` the log-ratio sums come from ``segment_log_ratio_sums`` (differentiable
    in the log-probs, a bool mask kept for backward); with it ([N], e.g. a ``masked_log_ratio`` that
    carries a gradient) they are its plain segment sums.
    """
    seg = batch.segments
    if token_log_ratio is None:
        log_ratio = segment_log_ratio_sums(batch)
    else:
        log_ratio = seg.sum(token_log_ratio)
    return SequenceSums(log_ratio, seg.count(batch.mask), _rollout_sums(batch))


def segment_log_ratio_sums(batch: TokenBatch, token_log_ratio: Tensor | None = None) -> Tensor:
    """[S] sum over each sequence's tokens of ``masked_log_ratio(logprobs, old_logprobs, mask)``.

    Differentiable in ``batch.logprobs`` and ``batch.old_logprobs`` (d sum_i / d logprobs_t = 1 where
    ``masked_log_ratio`` passes the gradient, for the tokens of sequence i). ``token_log_ratio``: the
    values of the masked log-ratio if already computed (no gradient is taken through it).
    """
    return _SegmentLogRatioSum.apply(batch.logprobs, batch.old_logprobs, batch.mask, batch.segments, token_log_ratio)


class _SegmentLogRatioSum(torch.autograd.Function):
    """``segments.sum(masked_log_ratio(logprobs, old, mask))`` as one op (see ``segment_log_ratio_sums``).

    It saves the bool mask of where the gradient passes (N bytes), like ``masked_log_ratio``, and its
    backward writes the gradient chunk by chunk into one tensor, where autograd of the two ops would
    hold the gathered gradient and its masked copy at once.
    """

    @staticmethod
    def forward(ctx, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, segments, token_log_ratio: Tensor | None) -> Tensor:
        out = torch.zeros(segments.num_seqs, dtype=compute_dtype(logprobs, old_logprobs), device=mask.device)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        keep = torch.empty(segments.num_tokens, dtype=torch.bool, device=mask.device) if need_grad else None
        for part in token_chunks(segments.num_tokens):
            if need_grad or token_log_ratio is None:
                values, chunk_keep = log_ratio_values(logprobs[part], old_logprobs[part], mask[part], with_keep=need_grad)
                if need_grad:
                    keep[part] = chunk_keep
            if token_log_ratio is not None:
                values = token_log_ratio[part].detach()
            out.index_add_(0, segments.seq_ids[part], values.to(out.dtype))
        if need_grad:
            ctx.save_for_backward(keep)
        ctx.segments, ctx.dtypes = segments, (logprobs.dtype, old_logprobs.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_sums: Tensor):
        (keep,) = ctx.saved_tensors
        seq_ids = ctx.segments.seq_ids
        grad = torch.empty(seq_ids.shape, dtype=grad_sums.dtype, device=grad_sums.device)
        for part in token_chunks(seq_ids.numel()):
            torch.index_select(grad_sums, 0, seq_ids[part], out=grad[part]).masked_fill_(keep[part].logical_not(), 0.0)
        grad_new = grad.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_old = (-grad).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_new, grad_old, None, None, None


def _rollout_sums(batch: TokenBatch) -> Tensor | None:
    """[S] sums of log pi_old - log pi_rollout (no gradient), or None without rollout log-probs."""
    if batch.rollout_logprobs is None:
        return None
    seg = batch.segments
    rollout = torch.zeros(seg.num_seqs, dtype=compute_dtype(batch.old_logprobs, batch.rollout_logprobs), device=batch.mask.device)
    for part in token_chunks(seg.num_tokens):
        gap, _ = log_ratio_values(batch.old_logprobs[part].detach(), batch.rollout_logprobs[part].detach(), batch.mask[part])
        rollout.index_add_(0, seg.seq_ids[part], gap)
    return rollout


@dataclass(frozen=True)
class SequenceContext:
    """What every loss reads: token log-ratios and the per-sequence sums before and after the CP reduce.

    token_log_ratio: [N] values of ``masked_log_ratio`` on this rank's tokens (no gradient: the losses
                     differentiate the log-probs through ``local.log_ratio`` or their own fused op);
    local:           [S] sums over this rank's tokens (``log_ratio`` carries the gradient);
    total:           [S] sums over the whole sequence (``local`` after ``reduce_sequence_sums``).
    """

    token_log_ratio: Tensor
    local: SequenceSums
    total: SequenceSums

    def share(self) -> Tensor:
        """[S] this rank's fraction of each sequence's tokens (1 without CP, 0 for an empty sequence):
        the weight of a per-sequence term that every CP rank evaluates."""
        return self.local.tokens / self.total.tokens.clamp(min=1.0)


def sequence_context(
    batch: TokenBatch, reduce_sequence_sums: ReduceSequenceSums | None = None, *, differentiable: bool = True
) -> SequenceContext:
    """Steps (a) and (*): token log-ratios, local sums and, through the caller's reduce, total sums.

    differentiable: False for the token-level losses (GSPO-token, GRPO), whose gradient reaches the
    log-probs through their own fused op and never through the sums (GSPO-token stops it: sg[s_i],
    Eq. 14); then no graph, and no mask for its backward, is kept.
    """
    token_log_ratio, _ = log_ratio_values(batch.logprobs.detach(), batch.old_logprobs.detach(), batch.mask)
    seg = batch.segments
    with torch.set_grad_enabled(torch.is_grad_enabled() and differentiable):
        log_ratio = segment_log_ratio_sums(batch, token_log_ratio)
        local = SequenceSums(log_ratio, seg.count(batch.mask), _rollout_sums(batch))
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


def token_tis_weights(batch: TokenBatch, cap: float, part: slice = slice(None)) -> Tensor:
    """[N] min(pi_old(y_t) / pi_rollout(y_t), cap) on response tokens (1 elsewhere), detached.

    ``part``: only these tokens (a chunk, see ``layout.token_chunks``).
    """
    if batch.rollout_logprobs is None:
        raise ValueError("tis_mode=token: the batch has no rollout_logprobs (the inference engine's log-probs)")
    log_w, _ = log_ratio_values(batch.old_logprobs[part].detach(), batch.rollout_logprobs[part].detach(), batch.mask[part])
    return log_w.clamp_(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp_().clamp_(max=cap)
