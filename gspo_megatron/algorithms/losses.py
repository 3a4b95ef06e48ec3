"""Policy losses: GSPO (Eq. 5-7), GSPO-token (Eq. 13-17), GRPO (token-level, clip-higher), KL and entropy.

Every loss is *minimised* (the negative of the paper's objective J), returns ``(loss, raw_metrics)``
(see ``metrics.py``) and divides by the global ``LossNormalisers`` of the whole mini-batch, so the
losses of its micro-batches (and data-parallel ranks) add up to the mini-batch loss.

Shapes: N tokens of S sequences in the flat layout of ``layout.TokenBatch``.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gspo_megatron.algorithms.kl import kl_estimate
from gspo_megatron.algorithms.layout import LossNormalisers, Segments, TokenBatch
from gspo_megatron.algorithms.metrics import raw
from gspo_megatron.algorithms.sequences import (
    LOG_RATIO_LIMIT,
    SequenceContext,
    SequenceSums,
    masked_log_ratio,
    sequence_context,
    sequence_tis_weights,
    token_tis_weights,
)

Aggregation = Literal["seq_mean_token_mean", "token_mean", "token_sum"]
TISMode = Literal["none", "sequence", "token"]
Metrics = dict[str, Tensor]


def clipped_objective(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), elementwise (Eq. 5 / Eq. 2).

    Also returns where the clip is *active*, i.e. where it removes the gradient: below the range with
    A < 0 (``clipped_low``) and above it with A > 0 (``clipped_high``).
    """
    low, high = 1.0 - clip_low, 1.0 + clip_high
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    with torch.no_grad():
        clipped_low = (ratio < low) & (advantages < 0)
        clipped_high = (ratio > high) & (advantages > 0)
    return objective, clipped_low, clipped_high


def aggregate_token_terms(
    terms: Tensor,
    segments: Segments,
    seq_tokens: Tensor,
    normalisers: LossNormalisers,
    aggregation: Aggregation,
    constant_length_tokens: int = 0,
) -> Tensor:
    """Reduce per-token terms ([N], 0 off the mask) to this micro-batch's share of the mini-batch loss.

    seq_mean_token_mean: sum_i (1/|y_i|) sum_t term_it / num_seqs   (|y_i| = ``seq_tokens``, whole sequence)
    token_mean:          sum_it term_it / num_tokens                 (weights each sequence by its length)
    token_sum:           sum_it term_it / (num_seqs * constant_length_tokens)   (Dr. GRPO)
    """
    if aggregation == "seq_mean_token_mean":
        per_seq = segments.sum(terms) / seq_tokens.clamp(min=1.0)
        return per_seq.sum() / _at_least_one(normalisers.num_seqs)
    if aggregation == "token_mean":
        return terms.sum() / _at_least_one(normalisers.num_tokens)
    if aggregation == "token_sum":
        if constant_length_tokens < 1:
            raise ValueError(f"aggregation=token_sum: constant_length_tokens must be >= 1, got {constant_length_tokens}")
        return terms.sum() / (_at_least_one(normalisers.num_seqs) * constant_length_tokens)
    raise ValueError(f"aggregation: must be one of seq_mean_token_mean, token_mean, token_sum, got {aggregation!r}")


def gspo_loss_from_sums(
    total: SequenceSums,
    advantages: Tensor,
    normalisers: LossNormalisers,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    share: Tensor | None = None,
    seq_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Step (b) of GSPO: from per-sequence sums to the loss, one clipped term per sequence.

        s_i  = exp( clamp( sum_t log(pi_theta/pi_old)(y_it) / |y_i|, -20, 20 ) )          (Eq. 7)
        loss = -(1/num_seqs) sum_i share_i w_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)   (Eq. 5)

    total:       whole-sequence sums (after the CP all-reduce, see ``sequences``);
    advantages:  [S] A_i;
    share:       [S] this rank's share of each sequence's tokens (default 1 for non-empty sequences);
    seq_weights: [S] detached per-sequence weights w_i (sequence-level TIS), default 1.
    The mean is over sequences, never over tokens: a sequence's length does not weight its term.
    """
    if share is None:
        share = (total.tokens > 0).to(torch.float32)
    seq_ratio = torch.exp(total.mean_log_ratio())
    objective, clipped_low, clipped_high = clipped_objective(seq_ratio, advantages.to(torch.float32), clip_low, clip_high)
    weight = share if seq_weights is None else share * seq_weights
    # where(), not a product: an empty sequence may carry any advantage (padding rows) and must add 0.
    terms = torch.where(share > 0, objective * weight, 0.0)
    loss = -terms.sum() / _at_least_one(normalisers.num_seqs)
    local_tokens = share * total.tokens
    metrics = {
        "clip_low_tokens": raw((clipped_low * local_tokens).sum()),
        "clip_high_tokens": raw((clipped_high * local_tokens).sum()),
        "clip_low_seqs": raw((clipped_low * share).sum()),
        "clip_high_seqs": raw((clipped_high * share).sum()),
        "pg_loss": raw(loss),
    }
    return loss, metrics


def gspo_loss(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    tis_mode: TISMode = "none",
    tis_cap: float = 2.0,
    context: SequenceContext | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO (Eq. 5, 7) on a micro-batch: steps (a) and (b) with the CP seam of ``context`` between them.

    Needs one advantage per sequence (``batch.advantages``); ``tis_mode`` may be none or sequence.
    """
    if batch.advantages is None:
        raise ValueError("gspo: needs one advantage per sequence (TokenBatch.advantages); per-token advantages need gspo_token")
    if tis_mode == "token":
        raise ValueError("gspo: tis_mode=token needs per-token loss terms; use tis_mode=sequence or gspo_token")
    ctx = sequence_context(batch) if context is None else context
    seq_weights, tis_metrics = _tis(batch, ctx, tis_mode, tis_cap)
    loss, metrics = gspo_loss_from_sums(
        ctx.total, batch.advantages, normalisers, clip_low=clip_low, clip_high=clip_high, share=ctx.share(), seq_weights=seq_weights
    )
    return loss, {**metrics, **tis_metrics, **policy_metrics(batch, ctx)}


def gspo_token_loss(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    tis_mode: TISMode = "none",
    tis_cap: float = 2.0,
    context: SequenceContext | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO-token (Eq. 13-17): per-token advantages with the sequence ratio.

        s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]                               (Eq. 14)
        loss = -(1/num_seqs) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it)          (Eq. 13)

    s_it equals s_i in value and d s_it / d log pi_theta(y_it) = s_i, so with A_it = A_i the value,
    clipping and gradient equal GSPO's (Eq. 15-17). Where the mean log-ratio of a sequence lies outside
    the exponent clamp, GSPO's gradient through the clamp is 0; the token form is gated the same way.
    """
    ctx = sequence_context(batch) if context is None else context
    seg = batch.segments
    with torch.no_grad():
        mean = ctx.total.log_ratio / ctx.total.tokens.clamp(min=1.0)
        in_range = seg.expand(mean.abs() <= LOG_RATIO_LIMIT) & batch.mask
        log_s = seg.expand(ctx.total.mean_log_ratio())  # value of log s_it = log sg[s_i]
    # d log s_it / d log pi_theta(y_it) = 1: the gradient flows into the log-probs themselves.
    return _token_level_loss(
        batch, ctx, normalisers, batch.logprobs, log_s, in_range, clip_low, clip_high, "seq_mean_token_mean", 0, tis_mode, tis_cap
    )


def grpo_loss(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.27,
    aggregation: Aggregation = "seq_mean_token_mean",
    constant_length_tokens: int = 0,
    tis_mode: TISMode = "none",
    tis_cap: float = 2.0,
    context: SequenceContext | None = None,
) -> tuple[Tensor, Metrics]:
    """GRPO with clip-higher: one clipped term per token with its own ratio (Eq. 2; gradient Eq. 11-12).

        w_t  = pi_theta(y_t) / pi_old(y_t) = exp(clamp(log-ratio_t, -20, 20))
        loss = -aggregate_t min(w_t A_t, clip(w_t, 1-eps_low, 1+eps_high) A_t)
    """
    ctx = sequence_context(batch) if context is None else context
    return _token_level_loss(
        batch,
        ctx,
        normalisers,
        ctx.token_log_ratio,
        ctx.token_log_ratio.detach(),
        None,
        clip_low,
        clip_high,
        aggregation,
        constant_length_tokens,
        tis_mode,
        tis_cap,
    )


def kl_penalty(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    estimator: Literal["k1", "k2", "k3"] = "k3",
    aggregation: Aggregation = "seq_mean_token_mean",
    constant_length_tokens: int = 0,
    seq_tokens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """KL(pi_theta || pi_ref) estimate aggregated like the policy loss (add ``kl_coef`` times it).

    seq_tokens: [S] whole-sequence token counts (``SequenceContext.total.tokens`` under CP); default local.
    """
    if batch.ref_logprobs is None:
        raise ValueError("kl_penalty: the batch has no ref_logprobs (log-probs of the frozen reference model)")
    kl = kl_estimate(batch.logprobs, batch.ref_logprobs, batch.mask, estimator)
    seq_tokens = _seq_tokens(batch) if seq_tokens is None else seq_tokens
    value = aggregate_token_terms(kl, batch.segments, seq_tokens, normalisers, aggregation, constant_length_tokens)
    return value, {"kl_sum": raw(kl.sum()), "kl_loss": raw(value)}


def entropy_bonus(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    aggregation: Aggregation = "seq_mean_token_mean",
    constant_length_tokens: int = 0,
    seq_tokens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Mean entropy aggregated like the policy loss (subtract ``entropy_coef`` times it)."""
    if batch.entropy is None:
        raise ValueError("entropy_bonus: the batch has no entropy (per-token entropy of pi_theta)")
    entropy = torch.where(batch.mask, batch.entropy.to(torch.float32), 0.0)
    seq_tokens = _seq_tokens(batch) if seq_tokens is None else seq_tokens
    value = aggregate_token_terms(entropy, batch.segments, seq_tokens, normalisers, aggregation, constant_length_tokens)
    return value, {"entropy_sum": raw(entropy.sum()), "entropy_loss": raw(value)}


def policy_metrics(batch: TokenBatch, ctx: SequenceContext) -> Metrics:
    """Ratio, log-ratio, advantage and mismatch metrics common to every algorithm (raw, see metrics.py)."""
    with torch.no_grad():
        mask, share = batch.mask, ctx.share()
        has_tokens = ctx.local.tokens > 0
        seq_ratio = torch.exp(ctx.total.mean_log_ratio())
        metrics = {
            "tokens": raw(ctx.local.tokens.sum()),
            "seqs": raw(share.sum()),
            "seq_ratio_sum": raw((seq_ratio * share).sum()),
            "seq_ratio_min": raw(_masked_min(seq_ratio, has_tokens)),
            "seq_ratio_max": raw(_masked_max(seq_ratio, has_tokens)),
            "abs_log_ratio_sum": raw(torch.linalg.vector_norm(ctx.token_log_ratio, ord=1)),
            **_token_ratio_metrics(ctx.token_log_ratio, mask),
        }
        metrics.update(_advantage_metrics(batch, ctx, share, has_tokens))
        if batch.rollout_logprobs is not None:
            gap = masked_log_ratio(batch.old_logprobs, batch.rollout_logprobs, mask)
            metrics["rollout_abs_log_ratio_sum"] = raw(torch.linalg.vector_norm(gap, ord=1))
    return metrics


class _ClippedTokenTerms(torch.autograd.Function):
    """Per-token loss terms  -w_t min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t)  (0 off the mask),
    with r_t = exp(clamp(log_ratio_t, -20, 20)), as one op that saves a single float per token.

    Autograd of the min/clamp/product expression would keep five N-float tensors for backward. Here
    forward computes d term_t / d x_t = -w_t A_t r_t g_t directly, where x is the tensor whose gradient
    moves log r_t one for one (the token log-ratio for GRPO, the log-probs for GSPO-token) and g_t is 0
    where the clip is active (the gradient the min removes, Eq. 5 / Eq. 2), where the exponent clamp
    is hit, off the mask, or where ``gate`` is False. Also returns the active-clip masks (for metrics).
    """

    @staticmethod
    def forward(ctx, x, log_ratio, gate, advantages, mask, weights, clip_low, clip_high):
        low, high = 1.0 - clip_low, 1.0 + clip_high
        ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp_()
        outside = ~mask
        clipped_low = ratio.lt(low).logical_and_(advantages.lt(0)).logical_and_(mask)
        clipped_high = ratio.gt(high).logical_and_(advantages.gt(0)).logical_and_(mask)
        no_grad = clipped_low | clipped_high
        no_grad |= log_ratio.lt(-LOG_RATIO_LIMIT)
        no_grad |= log_ratio.gt(LOG_RATIO_LIMIT)
        no_grad |= outside
        if gate is not None:
            no_grad |= ~gate
        coef = ratio * advantages
        if weights is not None:
            coef.mul_(weights)
        coef.neg_().masked_fill_(no_grad, 0.0)
        terms = ratio.masked_fill_(clipped_low, low).masked_fill_(clipped_high, high).mul_(advantages)
        if weights is not None:
            terms.mul_(weights)
        terms.neg_().masked_fill_(outside, 0.0)  # advantages off the mask may be anything, even NaN
        ctx.save_for_backward(coef)
        ctx.x_dtype = x.dtype
        ctx.mark_non_differentiable(clipped_low, clipped_high)
        return terms, clipped_low, clipped_high

    @staticmethod
    def backward(ctx, grad_terms, _grad_low, _grad_high):
        (coef,) = ctx.saved_tensors
        return (grad_terms * coef).to(ctx.x_dtype), None, None, None, None, None, None, None


def _token_level_loss(
    batch: TokenBatch,
    ctx: SequenceContext,
    normalisers: LossNormalisers,
    x: Tensor,
    log_ratio: Tensor,
    gate: Tensor | None,
    clip_low: float,
    clip_high: float,
    aggregation: Aggregation,
    constant_length_tokens: int,
    tis_mode: TISMode,
    tis_cap: float,
) -> tuple[Tensor, Metrics]:
    """Shared tail of GSPO-token and GRPO: clipped per-token terms, TIS weights, aggregation, metrics."""
    seg, mask = batch.segments, batch.mask
    seq_weights, tis_metrics = _tis(batch, ctx, tis_mode, tis_cap)
    weights = None if seq_weights is None else seg.expand(seq_weights)
    if tis_mode == "token":
        weights = token_tis_weights(batch, tis_cap)
        tis_metrics = {
            "tis_token_weight_sum": raw(torch.where(mask, weights, 0.0).sum()),
            "tis_token_truncated": raw((mask & (weights >= tis_cap)).sum()),
        }
    advantages = batch.token_advantage().to(torch.float32)
    terms, clipped_low, clipped_high = _ClippedTokenTerms.apply(
        x, log_ratio, gate, advantages, mask, weights, clip_low, clip_high
    )
    del advantages, weights
    loss = aggregate_token_terms(terms, seg, ctx.total.tokens, normalisers, aggregation, constant_length_tokens)
    del terms  # not saved for backward; free it before the metrics' scratch
    with torch.no_grad():
        seq_tokens = ctx.total.tokens.clamp(min=1.0)
        metrics = {
            "clip_low_tokens": raw(clipped_low.sum()),
            "clip_high_tokens": raw(clipped_high.sum()),
            "clip_low_seqs": raw((seg.sum(clipped_low.to(torch.float32)) / seq_tokens).sum()),
            "clip_high_seqs": raw((seg.sum(clipped_high.to(torch.float32)) / seq_tokens).sum()),
            "pg_loss": raw(loss),
        }
    del clipped_low, clipped_high
    return loss, {**metrics, **tis_metrics, **policy_metrics(batch, ctx)}


def _tis(batch: TokenBatch, ctx: SequenceContext, tis_mode: TISMode, tis_cap: float) -> tuple[Tensor | None, Metrics]:
    """Sequence-level TIS weights [S] and their metrics (token-level weights are applied per token)."""
    if tis_mode not in ("none", "sequence", "token"):
        raise ValueError(f"tis_mode: must be one of none, sequence, token, got {tis_mode!r}")
    if tis_mode != "sequence":
        return None, {}
    weights = sequence_tis_weights(ctx.total, tis_cap)
    share = ctx.share()
    return weights, {
        "tis_seq_weight_sum": raw((weights * share).sum()),
        "tis_seq_truncated": raw(((weights >= tis_cap) * share).sum()),
    }


def _advantage_metrics(batch: TokenBatch, ctx: SequenceContext, share: Tensor, has_tokens: Tensor) -> Metrics:
    """Token-weighted advantage statistics and the share of sequences whose advantage is 0 everywhere."""
    if batch.advantages is not None:
        adv = torch.where(has_tokens, batch.advantages.to(torch.float32), 0.0)
        tokens = ctx.local.tokens
        adv_sum, adv_sq_sum = (adv * tokens).sum(), (adv * adv * tokens).sum()
        present, zero_seq = has_tokens, adv == 0
    else:
        adv = torch.where(batch.mask, batch.token_advantages.to(torch.float32), 0.0)
        adv_sum, adv_sq_sum = adv.sum(), (adv * adv).sum()
        present = batch.mask
        nonzero = batch.segments.sum((adv != 0).to(torch.float32))
        zero_seq = has_tokens & (nonzero == 0)
    return {
        "adv_sum": raw(adv_sum),
        "adv_sq_sum": raw(adv_sq_sum),
        "adv_min": raw(_masked_min(adv, present)),
        "adv_max": raw(_masked_max(adv, present)),
        "zero_adv_seqs": raw((zero_seq * share).sum()),
    }


def _token_ratio_metrics(token_log_ratio: Tensor, mask: Tensor) -> Metrics:
    """Sum, min and max of pi_theta / pi_old over response tokens, with one N-float scratch at a time.

    The sum is taken over ratio - 1, which is 0 off the mask (log-ratio 0 there), plus the token count.
    """
    clamped_min = _masked_min(token_log_ratio, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    clamped_max = _masked_max(token_log_ratio, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    excess = token_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp_().sub_(1.0).sum()
    empty = mask.sum() == 0
    return {
        "token_ratio_sum": raw(excess + mask.sum()),
        "token_ratio_min": raw(torch.where(empty, float("inf"), clamped_min.exp())),
        "token_ratio_max": raw(torch.where(empty, float("-inf"), clamped_max.exp())),
    }


def _masked_min(values: Tensor, mask: Tensor) -> Tensor:
    """Minimum over ``mask``; +inf (the identity of min, for reductions) when nothing is selected."""
    if values.numel() == 0:
        return torch.full((), float("inf"), device=values.device)
    return torch.where(mask, values, float("inf")).amin()


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Maximum over ``mask``; -inf (the identity of max) when nothing is selected."""
    if values.numel() == 0:
        return torch.full((), float("-inf"), device=values.device)
    return torch.where(mask, values, float("-inf")).amax()


def _seq_tokens(batch: TokenBatch) -> Tensor:
    return batch.segments.sum(batch.mask.to(torch.float32))


def _at_least_one(count: float | Tensor) -> float | Tensor:
    """A normaliser, with 0 (an empty mini-batch) read as 1 so the loss is 0 rather than NaN."""
    if isinstance(count, Tensor):
        return count.clamp(min=1.0)
    return max(float(count), 1.0)
