"""Policy losses: GSPO (Eq. 5-7), GSPO-token (Eq. 13-17), GRPO (token-level, clip-higher), SAPO, CISPO,
KL and entropy.

Every loss is *minimised* (the negative of the paper's objective J), returns ``(loss, raw_metrics)``
(see ``metrics.py``) and divides by the global ``LossNormalisers`` of the whole mini-batch, so the
losses of its micro-batches (and data-parallel ranks) add up to the mini-batch loss. The policy
losses share one signature, ``(batch, normalisers, config, context)``, and read their clip range and
TIS settings from the ``LossConfig`` (which holds the paper's values); ``policy.POLICY_LOSSES`` maps an
algorithm name to its loss.

Shapes: N tokens of S sequences in the flat layout of ``layout.TokenBatch``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from gspo_megatron.algorithms.config import Aggregation, LossConfig, TISMode
from gspo_megatron.algorithms.kl import KLEstimator, distill_values_and_derivative, kl_values_and_derivative
from gspo_megatron.algorithms.layout import (
    LossNormalisers,
    Segments,
    TokenBatch,
    compute_dtype,
    token_chunks,
)
from gspo_megatron.algorithms.metrics import raw
from gspo_megatron.algorithms.rollout_correction import (
    icepop_metrics,
    icepop_weights,
    opsm_divergent,
    opsm_token_keep,
    sequence_keep,
)
from gspo_megatron.algorithms.sequences import (
    LOG_RATIO_LIMIT,
    SequenceContext,
    SequenceSums,
    log_ratio_values,
    sequence_context,
    sequence_tis_weights,
    token_tis_weights,
)

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


def dual_clipped(objective: Tensor, ratio: Tensor, advantages: Tensor, c: float | None) -> tuple[Tensor, Tensor | None]:
    """Dual clip (Ye et al., arXiv 1912.09729): max(objective, c A) where A < 0, elementwise.

    A term with A < 0 whose ratio exceeds c > 1 contributes c A and no gradient, so one token (or
    sequence) the policy has moved far from cannot dominate the loss. Also returns where it is active.
    """
    if c is None:
        return objective, None
    with torch.no_grad():
        active = (advantages < 0) & (ratio > c)
    return torch.where(active, c * advantages, objective), active


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
    scale = token_scale(aggregation, seq_tokens, normalisers, constant_length_tokens)
    if scale.seq_tokens is None:
        return terms.sum() / scale.denominator
    return (segments.sum(terms) / scale.seq_tokens.clamp(min=1.0)).sum() / scale.denominator


def gspo_loss_from_sums(
    total: SequenceSums,
    advantages: Tensor,
    normalisers: LossNormalisers,
    *,
    clip_low: float,
    clip_high: float,
    share: Tensor | None = None,
    seq_weights: Tensor | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """Step (b) of GSPO: from per-sequence sums to the loss, one clipped term per sequence.

        s_i  = exp( clamp( sum_t log(pi_theta/pi_old)(y_it) / |y_i|, -20, 20 ) )          (Eq. 7)
        loss = -(1/num_seqs) sum_i share_i w_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)   (Eq. 5)

    (with ``dual_clip`` c: the min is raised to at least c A_i where A_i < 0, see ``dual_clipped``)

    total:       whole-sequence sums (after the CP all-reduce, see ``sequences``);
    advantages:  [S] A_i;
    share:       [S] this rank's share of each sequence's tokens (default 1 for non-empty sequences);
    seq_weights: [S] detached per-sequence weights w_i (sequence-level TIS), default 1.
    The mean is over sequences, never over tokens: a sequence's length does not weight its term.
    """
    if share is None:
        share = (total.tokens > 0).to(torch.float32)
    seq_ratio = torch.exp(total.mean_log_ratio())
    advantages = advantages.to(seq_ratio.dtype)
    objective, clipped_low, clipped_high = clipped_objective(seq_ratio, advantages, clip_low, clip_high)
    objective, clipped_dual = dual_clipped(objective, seq_ratio, advantages, dual_clip)
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
    if clipped_dual is not None:
        metrics["clip_dual_tokens"] = raw((clipped_dual * local_tokens).sum())
    return loss, metrics


def gspo_loss(
    batch: TokenBatch, normalisers: LossNormalisers, config: LossConfig, context: SequenceContext | None = None
) -> tuple[Tensor, Metrics]:
    """GSPO (Eq. 5, 7) on a micro-batch: steps (a) and (b) with the CP seam of ``context`` between them.

    Needs one advantage per sequence (``batch.advantages``); ``config.tis_mode`` may be none or sequence.
    """
    _check_sequence_mean("gspo", config)
    if batch.advantages is None:
        raise ValueError("gspo: needs one advantage per sequence (TokenBatch.advantages); per-token advantages need gspo_token")
    if config.tis_mode == "token":
        raise ValueError("gspo: tis_mode=token needs per-token loss terms; use tis_mode=sequence or gspo_token")
    ctx = sequence_context(batch) if context is None else context
    seq_weights, tis_metrics = _sequence_weights(batch, ctx, config)
    loss, metrics = gspo_loss_from_sums(
        ctx.total,
        batch.advantages,
        normalisers,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        share=ctx.share(),
        seq_weights=seq_weights,
        dual_clip=config.dual_clip_c,
    )
    return loss, {**metrics, **tis_metrics, **policy_metrics(batch, ctx)}


def gspo_token_loss(
    batch: TokenBatch, normalisers: LossNormalisers, config: LossConfig, context: SequenceContext | None = None
) -> tuple[Tensor, Metrics]:
    """GSPO-token (Eq. 13-17): per-token advantages with the sequence ratio.

        s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]                               (Eq. 14)
        loss = -(1/num_seqs) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it)          (Eq. 13)

    s_it equals s_i in value and d s_it / d log pi_theta(y_it) = s_i, so with A_it = A_i the value,
    clipping and gradient equal GSPO's (Eq. 15-17). Where the mean log-ratio of a sequence lies outside
    the exponent clamp, GSPO's gradient through the clamp is 0; the token form is gated the same way.
    """
    _check_sequence_mean("gspo_token", config)
    ctx = sequence_context(batch, differentiable=False) if context is None else context
    with torch.no_grad():
        mean = ctx.total.log_ratio / ctx.total.tokens.clamp(min=1.0)
        ratio = _TokenRatio(seq_ratio=torch.exp(ctx.total.mean_log_ratio()), seq_stopped=~(mean.abs() <= LOG_RATIO_LIMIT))
    return _token_level_loss(batch, ctx, normalisers, ratio, config, "seq_mean_token_mean", 0)


def grpo_loss(
    batch: TokenBatch, normalisers: LossNormalisers, config: LossConfig, context: SequenceContext | None = None
) -> tuple[Tensor, Metrics]:
    """GRPO with clip-higher: one clipped term per token with its own ratio (Eq. 2; gradient Eq. 11-12).

        w_t  = pi_theta(y_t) / pi_old(y_t) = exp(clamp(log-ratio_t, -20, 20))
        loss = -aggregate_t min(w_t A_t, clip(w_t, 1-eps_low, 1+eps_high) A_t)

    aggregated by ``config.aggregation`` (and ``config.constant_length_tokens`` for token_sum).
    """
    ctx = sequence_context(batch, differentiable=False) if context is None else context
    ratio = _TokenRatio(token_log_ratio=ctx.token_log_ratio.detach())
    return _token_level_loss(batch, ctx, normalisers, ratio, config, config.aggregation, config.constant_length_tokens)


def sapo_loss(
    batch: TokenBatch, normalisers: LossNormalisers, config: LossConfig, context: SequenceContext | None = None
) -> tuple[Tensor, Metrics]:
    """SAPO (Gao et al., arXiv 2511.20347, its objective): a soft gate on each token's ratio in place of the clip.

        r_t  = exp(clamp(log-ratio_t, -20, 20)),   tau_t = sapo_tau_pos if A_t > 0 else sapo_tau_neg
        f(r) = (4 / tau_t) sigmoid(tau_t (r - 1))
        loss = -(1/num_seqs) sum_i (1/|y_i|) sum_t f(r_it) A_it

    d loss / d log pi_theta(y_t) = -(1/num_seqs)(1/|y_i|) A_t w_t r_t with w_t = 4 sigma (1 - sigma), the
    gate's slope: 1 at r = 1 (on-policy: the plain policy gradient), decaying smoothly as r leaves 1 --
    faster for A < 0, where tau_neg > tau_pos. No gradient where the exponent clamp is hit.
    """
    _check_sequence_mean("sapo", config)
    ctx = sequence_context(batch, differentiable=False) if context is None else context
    tau_pos, tau_neg = config.sapo_tau_pos, config.sapo_tau_neg

    def kernel(log_r: Tensor, adv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # in place where it can be: every temporary here is one chunk of a token tensor
        ratio = log_r.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        stopped = ratio.ne(log_r)  # the exponent clamp is hit (or NaN): no gradient, like torch.clamp
        ratio.exp_()
        tau = torch.full_like(adv, tau_neg).masked_fill_(adv > 0, tau_pos)
        gate = ratio.sub(1.0).mul_(tau).sigmoid_()
        slope = gate.neg().add_(1.0).mul_(gate).mul_(4.0)  # 4 sigma (1 - sigma)
        derivative = ratio.mul_(slope).mul_(adv).masked_fill_(stopped, 0.0)  # A w r
        return gate.mul_(adv).mul_(4.0).div_(tau), derivative, slope

    return _term_loss(batch, ctx, normalisers, config, kernel, "seq_mean_token_mean", 0, "sapo_gate_slope_sum")


def cispo_loss(
    batch: TokenBatch, normalisers: LossNormalisers, config: LossConfig, context: SequenceContext | None = None
) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, its objective): the clipped importance weight, detached, times A
    times the token's log-prob, so every token keeps a gradient (none is dropped by a clip).

        r_hat_t = clip(r_t, 1 - clip_low, 1 + clip_high),  r_t = exp(clamp(log-ratio_t, -20, 20))
        loss    = -aggregate_t sg[r_hat_t] A_t log pi_theta(y_t)          (token_mean: the paper's 1 / sum|y_i|)

    d loss / d log pi_theta(y_t) = -scale_t r_hat_t A_t. The value is reported as
    -aggregate sg[r_hat] A (log pi_theta - log pi_old): it differs from the paper's by a constant (pi_old
    is fixed), so the gradient is the same, while the value is 0 on-policy and stays finite however
    small a log-prob is.
    """
    ctx = sequence_context(batch, differentiable=False) if context is None else context
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high

    def kernel(log_r: Tensor, adv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ratio = log_r.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp_()
        weight = ratio.clamp(low, high)
        clipped = ratio.ne(weight)
        derivative = weight.mul_(adv)  # r_hat A
        return derivative.mul(log_r), derivative, clipped

    return _term_loss(batch, ctx, normalisers, config, kernel, config.aggregation, config.constant_length_tokens,
                      "cispo_clipped_tokens")


def kl_penalty(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    estimator: KLEstimator,
    aggregation: Aggregation,
    constant_length_tokens: int = 0,
    seq_tokens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """KL(pi_theta || pi_ref) estimate aggregated like the policy loss (add ``kl_coef`` times it).

    seq_tokens: [S] whole-sequence token counts (``SequenceContext.total.tokens`` under CP); default local.
    Value and gradient equal ``aggregate_token_terms(kl_estimate(...))``; computed by a fused op that
    keeps no per-token tensor for backward (it recomputes the derivative there, chunk by chunk).
    """
    if batch.ref_logprobs is None:
        raise ValueError("kl_penalty: the batch has no ref_logprobs (log-probs of the frozen reference model)")
    if estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"kl_estimator: must be one of k1, k2, k3, got {estimator!r}")
    seq_tokens = batch.segments.count(batch.mask) if seq_tokens is None else seq_tokens
    scale = token_scale(aggregation, seq_tokens, normalisers, constant_length_tokens)
    logprobs, ref, mask = batch.logprobs, batch.ref_logprobs, batch.mask

    def values(part: slice) -> Tensor:
        return kl_values_and_derivative(logprobs[part], ref[part], mask[part], estimator, with_derivative=False)[0]

    def derivative(part: slice) -> Tensor:
        return kl_values_and_derivative(logprobs[part], ref[part], mask[part], estimator, with_derivative=True)[1]

    sums: Metrics = {}
    value = _TokenSum.apply(logprobs, values, derivative, scale, batch.segments, sums)
    return value, {"kl_sum": raw(sums["raw_sum"]), "kl_loss": raw(value)}


def distill_penalty(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    estimator: str,
    aggregation: Aggregation,
    constant_length_tokens: int = 0,
    seq_tokens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """On-policy distillation: the per-token reverse KL(pi_theta || pi_teacher) on the student's own samples,
    aggregated like the policy loss (add ``distill.coef`` times it). Shapes: [N] tokens, [S] sequences.

        d_t  = log pi_theta(y_t) - log pi_teacher(y_t)                   (y_t sampled by the student)
        k1:  value  sum_agg d_t,              grad  sum_agg sg[d_t] d log pi_theta(y_t)
        k3:  value  sum_agg (r_t - 1 - log r_t), r_t = exp(-d_t),   grad  sum_agg (1 - r_t) d log pi_theta(y_t)

    where sum_agg is ``aggregate_token_terms`` (GSPO: (1/num_seqs) sum_i (1/|y_i|) sum_t). The term is
    dense and per token: it is neither weighted by nor clipped with GSPO's sequence ratio s_i (the samples
    are the current step's, so pi_theta = pi_old at the first mini-batch; docs/algorithms.md says why).
    A teacher equal to the student gives value 0 and gradient 0. Fused like ``kl_penalty`` (no per-token
    tensor kept for backward). Metrics: ``distill_kl_sum`` (sum of the estimator's values: its mean is
    the logged ``distill_kl_mean``) and ``distill_loss``.
    """
    if batch.teacher_logprobs is None:
        raise ValueError("distill_penalty: the batch has no teacher_logprobs (log-probs of the distillation teacher)")
    if estimator not in ("k1", "k3"):
        raise ValueError(f"distill.estimator: must be k1 or k3, got {estimator!r}")
    seq_tokens = batch.segments.count(batch.mask) if seq_tokens is None else seq_tokens
    scale = token_scale(aggregation, seq_tokens, normalisers, constant_length_tokens)
    logprobs, teacher, mask = batch.logprobs, batch.teacher_logprobs, batch.mask

    def values(part: slice) -> Tensor:
        return distill_values_and_derivative(logprobs[part], teacher[part], mask[part], estimator,
                                             with_derivative=False)[0]

    def derivative(part: slice) -> Tensor:
        return distill_values_and_derivative(logprobs[part], teacher[part], mask[part], estimator,
                                             with_derivative=True)[1]

    sums: Metrics = {}
    value = _TokenSum.apply(logprobs, values, derivative, scale, batch.segments, sums)
    return value, {"distill_kl_sum": raw(sums["raw_sum"]), "distill_loss": raw(value)}


def entropy_bonus(
    batch: TokenBatch,
    normalisers: LossNormalisers,
    *,
    aggregation: Aggregation,
    constant_length_tokens: int = 0,
    seq_tokens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Mean entropy aggregated like the policy loss (subtract ``entropy_coef`` times it).

    A fused op like ``kl_penalty``'s: d value / d entropy_t is the token's aggregation weight.
    """
    if batch.entropy is None:
        raise ValueError("entropy_bonus: the batch has no entropy (per-token entropy of pi_theta)")
    seq_tokens = batch.segments.count(batch.mask) if seq_tokens is None else seq_tokens
    scale = token_scale(aggregation, seq_tokens, normalisers, constant_length_tokens)
    entropy, mask = batch.entropy, batch.mask

    dtype = compute_dtype(entropy)

    def values(part: slice) -> Tensor:
        return torch.where(mask[part], entropy[part].detach().to(dtype), 0.0)

    def derivative(part: slice) -> Tensor:  # needs only the mask: the entropy itself is not kept for backward
        return mask[part].to(dtype)

    sums: Metrics = {}
    value = _TokenSum.apply(entropy, values, derivative, scale, batch.segments, sums)
    return value, {"entropy_sum": raw(sums["raw_sum"]), "entropy_loss": raw(value)}


def policy_metrics(batch: TokenBatch, ctx: SequenceContext) -> Metrics:
    """Ratio, log-ratio, advantage and mismatch metrics common to every algorithm (raw, see metrics.py).

    Per-token scratch is made chunk by chunk (``layout.token_chunks``).
    """
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
            **_token_ratio_metrics(ctx.token_log_ratio.detach(), mask),
        }
        metrics.update(_advantage_metrics(batch, ctx, share, has_tokens))
        if batch.rollout_logprobs is not None:
            metrics.update(_logprob_gap_metrics(batch))
    return metrics


def _logprob_gap_metrics(batch: TokenBatch) -> Metrics:
    """The train/rollout mismatch d_t = log pi_old(y_t) - log pi_rollout(y_t) on response tokens: sums of
    |d_t| and d_t and the maximum |d_t| (paper section 5.4), chunk by chunk."""
    mask = batch.mask
    abs_sum, signed_sum = torch.zeros((), device=mask.device), torch.zeros((), device=mask.device)
    abs_max = torch.full((), float("-inf"), device=mask.device)
    for part in token_chunks(mask.numel()):
        gap, _ = log_ratio_values(batch.old_logprobs[part].detach(), batch.rollout_logprobs[part].detach(), mask[part])
        signed_sum += gap.sum()
        gap.abs_()
        abs_sum += gap.sum()
        abs_max = torch.maximum(abs_max, _masked_max(gap, mask[part]))
    return {"logprob_gap_abs_sum": raw(abs_sum), "logprob_gap_signed_sum": raw(signed_sum), "logprob_gap_abs_max": raw(abs_max)}


@dataclass(frozen=True)
class TokenScale:
    """How per-token terms l_t reduce to this micro-batch's share of the loss (see ``aggregate_token_terms``).

    seq_tokens [S] given:  loss = sum_i (1 / max(seq_tokens_i, 1)) sum_t l_it / denominator
    seq_tokens None:       loss = sum_t l_t / denominator
    Build it with ``token_scale``.
    """

    seq_tokens: Tensor | None
    denominator: float | Tensor

    def per_seq(self, dtype: torch.dtype) -> Tensor | None:
        """[S] d loss / d l_t of each sequence's tokens, or None when it is one scalar (``per_token``)."""
        if self.seq_tokens is None:
            return None
        return 1.0 / (self.seq_tokens.to(dtype).clamp(min=1.0) * self.denominator)

    def per_token(self, seq_ids: Tensor, per_seq: Tensor | None) -> Tensor | float:
        """d loss / d l_t for the tokens of ``seq_ids`` (a chunk) from ``per_seq()``, or the uniform scalar."""
        if per_seq is None:
            return 1.0 / self.denominator
        return per_seq.index_select(0, seq_ids)

    def accumulator(self, num_seqs: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Zeros to ``accumulate`` chunks into: [S] per-sequence sums, or a 0-d total."""
        return torch.zeros(num_seqs if self.seq_tokens is not None else (), dtype=dtype, device=device)

    def accumulate(self, acc: Tensor, seq_ids: Tensor, terms: Tensor) -> None:
        if self.seq_tokens is None:
            acc += terms.sum()
        else:
            acc.index_add_(0, seq_ids, terms)

    def reduce(self, acc: Tensor) -> Tensor:
        """The loss from the accumulated chunks (sums per sequence first, as ``aggregate_token_terms`` does)."""
        if self.seq_tokens is None:
            return acc / self.denominator
        return (acc / self.seq_tokens.clamp(min=1.0)).sum() / self.denominator


def token_scale(
    aggregation: Aggregation, seq_tokens: Tensor, normalisers: LossNormalisers, constant_length_tokens: int = 0
) -> TokenScale:
    """The ``TokenScale`` of an aggregation mode (formulas in ``aggregate_token_terms``)."""
    if aggregation == "seq_mean_token_mean":
        return TokenScale(seq_tokens, _at_least_one(normalisers.num_seqs))
    if aggregation == "token_mean":
        return TokenScale(None, _at_least_one(normalisers.num_tokens))
    if aggregation == "token_sum":
        if constant_length_tokens < 1:
            raise ValueError(f"aggregation=token_sum: constant_length_tokens must be >= 1, got {constant_length_tokens}")
        return TokenScale(None, _at_least_one(normalisers.num_seqs) * constant_length_tokens)
    raise ValueError(f"aggregation: must be one of seq_mean_token_mean, token_mean, token_sum, got {aggregation!r}")


class _TokenSum(torch.autograd.Function):
    """loss = scale-reduction of per-token terms f_t (KL, entropy) as one op that allocates no per-token
    tensor for backward: forward and backward run chunk by chunk, and backward recomputes d f_t / d x_t
    (elementwise, cheap) with ``derivative(part)``. ``values(part)`` gives f on a chunk in forward only;
    the tensors ``derivative`` reads (KL: log-probs, reference log-probs and mask; entropy: the mask)
    stay referenced until backward. ``sums["raw_sum"]`` receives sum_t f_t (the metric)."""

    @staticmethod
    def forward(ctx, x: Tensor, values, derivative, scale: TokenScale, segments: Segments, sums: Metrics) -> Tensor:
        dtype = compute_dtype(x)
        acc = scale.accumulator(segments.num_seqs, dtype, x.device)
        raw_sum = torch.zeros((), dtype=dtype, device=x.device)
        for part in token_chunks(segments.num_tokens):
            chunk = values(part).to(dtype)
            raw_sum += chunk.sum()
            scale.accumulate(acc, segments.seq_ids[part], chunk)
        sums["raw_sum"] = raw_sum
        ctx.derivative, ctx.scale, ctx.segments, ctx.x_meta = derivative, scale, segments, (x.shape, x.dtype)
        return scale.reduce(acc)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        shape, dtype = ctx.x_meta
        grad = torch.empty(ctx.segments.num_tokens, dtype=compute_dtype(grad_loss), device=grad_loss.device)
        per_seq = ctx.scale.per_seq(grad.dtype)
        for part in token_chunks(ctx.segments.num_tokens):
            scaled = ctx.derivative(part).mul_(ctx.scale.per_token(ctx.segments.seq_ids[part], per_seq))
            torch.mul(scaled, grad_loss, out=grad[part])
        return _as_input(grad, shape, dtype), None, None, None, None, None


@dataclass(frozen=True)
class _TokenRatio:
    """The ratio a token's clipped term uses, without a per-token copy when it is per sequence.

    token_log_ratio: [N] GRPO: the token's own log-ratio; r_t = exp(clamp(., -20, 20)), no gradient
                     where the clamp is hit.
    seq_ratio:       [S] GSPO-token: s_i (Eq. 14 in value); seq_stopped [S] bool: no gradient for the
                     sequence (its mean log-ratio is outside the exponent clamp).
    Either way d log r_t / d log pi_theta(y_t) = 1 where the gradient flows.
    """

    token_log_ratio: Tensor | None = None
    seq_ratio: Tensor | None = None
    seq_stopped: Tensor | None = None


@dataclass(frozen=True)
class _ClipInputs:
    """What the fused clipped objective reads besides log pi_theta (all detached)."""

    batch: TokenBatch
    ratio: _TokenRatio
    seq_weights: Tensor | None  # [S] sequence-level TIS and masks
    token_weights: TokenWeights | None  # token-level TIS / IcePop weights, recomputed per chunk
    clip_low: float
    clip_high: float
    scale: TokenScale
    dual_clip: float | None = None


class _SavedCoefficientLoss(torch.autograd.Function):
    """A reduced token loss whose forward saved d loss / d x as ``coef`` (the one per-token tensor kept) and
    the input's shape and dtype as ``ctx.x_meta``: backward scales it by the incoming scalar."""

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        (coef,) = ctx.saved_tensors
        shape, dtype = ctx.x_meta
        return _as_input(coef * grad_loss, shape, dtype), None, None


class _ClippedTokenLoss(_SavedCoefficientLoss):
    """The reduced token-level clipped objective as one op (GSPO-token, GRPO):

        loss = scale-reduction of  l_t = -w_t min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t)  (0 off the mask)

    with the derivative taken directly with respect to x = log pi_theta (the ``batch.logprobs``):

        d loss / d x_t = -scale_t w_t A_t r_t g_t

    where g_t is 0 where the clip is active (r < 1-eps_low with A < 0, r > 1+eps_high with A > 0: the
    gradient the min removes, Eq. 5 / Eq. 2), where the ratio's exponent clamp is hit, and off the mask.
    Forward runs chunk by chunk (``layout.token_chunks``) and writes that derivative into the one
    per-token tensor it saves (float32; float64 for float64 inputs); backward multiplies it by the
    incoming scalar. Nothing else per token is kept. ``metrics`` receives the per-sequence counts of clipped tokens (``clip_low`` and
    ``clip_high``, [S]). With ``dual_clip`` c, a term with A < 0 and r > c is c A with no gradient
    (``dual_clipped``), counted in ``metrics["clip_dual"]``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, inputs: _ClipInputs, metrics: Metrics) -> Tensor:
        batch, ratio, scale = inputs.batch, inputs.ratio, inputs.scale
        seg, mask, device = batch.segments, batch.mask, batch.mask.device
        low_bound, high_bound = 1.0 - inputs.clip_low, 1.0 + inputs.clip_high
        need_grad, dtype = ctx.needs_input_grad[0], compute_dtype(x, batch.old_logprobs)
        coef = torch.empty(seg.num_tokens, dtype=dtype, device=device) if need_grad else None
        acc = scale.accumulator(seg.num_seqs, dtype, device)
        low_counts = torch.zeros(seg.num_seqs, dtype=torch.float32, device=device)
        high_counts = torch.zeros_like(low_counts)
        dual_count = torch.zeros((), dtype=torch.float32, device=device)
        per_seq_scale = scale.per_seq(dtype)
        neg_seq_adv = None if batch.advantages is None else batch.advantages.detach().to(dtype).neg()
        seq_ratio = None if ratio.seq_ratio is None else ratio.seq_ratio.to(dtype)
        for part in token_chunks(seg.num_tokens):
            ids, on = seg.seq_ids[part], mask[part]
            buf = coef[part] if need_grad else torch.empty(ids.shape, dtype=dtype, device=device)
            if ratio.token_log_ratio is not None:
                log_r = ratio.token_log_ratio[part].to(dtype)
                torch.clamp(log_r, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT, out=buf)
                stopped = buf.ne(log_r)  # the exponent clamp is hit (or NaN): no gradient, like torch.clamp
                buf.exp_()
            else:
                torch.index_select(seq_ratio, 0, ids, out=buf)
                stopped = ratio.seq_stopped.index_select(0, ids)
            # factor = -A (a new tensor: never a view of the caller's advantages), times TIS weights
            if neg_seq_adv is not None:
                factor = neg_seq_adv.index_select(0, ids)
            else:
                factor = batch.token_advantages[part].detach().to(dtype).neg()
            clipped_low = buf.lt(low_bound).logical_and_(factor.gt(0)).logical_and_(on)
            clipped_high = buf.gt(high_bound).logical_and_(factor.lt(0)).logical_and_(on)
            low_counts.index_add_(0, ids, clipped_low.to(torch.float32))
            high_counts.index_add_(0, ids, clipped_high.to(torch.float32))
            if inputs.dual_clip is not None:  # A < 0 and r > c (> 1): disjoint from clipped_low, r < 1 - eps_low there
                clipped_dual = buf.gt(inputs.dual_clip).logical_and_(factor.gt(0)).logical_and_(on)
                dual_count += clipped_dual.sum()
            if inputs.seq_weights is not None:
                factor.mul_(inputs.seq_weights.index_select(0, ids))
            if inputs.token_weights is not None:
                factor.mul_(inputs.token_weights(part))
            # min(r A, clip(r) A) = clip(r) A exactly where the clip is active, r A elsewhere
            off = ~on
            buf.masked_fill_(clipped_low, low_bound).masked_fill_(clipped_high, high_bound)
            if inputs.dual_clip is not None:
                buf.masked_fill_(clipped_dual, inputs.dual_clip)
                clipped_high.logical_or_(clipped_dual)  # stops the gradient below, like the other clips
            buf.mul_(factor).masked_fill_(off, 0.0)  # advantages off the mask may be anything, even NaN
            del factor
            scale.accumulate(acc, ids, buf)
            if need_grad:  # where the gradient flows the clipped ratio is r itself, so buf = -w A r there
                stopped.logical_or_(clipped_low).logical_or_(clipped_high).logical_or_(off)
                buf.masked_fill_(stopped, 0.0).mul_(scale.per_token(ids, per_seq_scale))
            del buf, stopped, clipped_low, clipped_high, off  # before the next chunk makes its own
        metrics["clip_low"], metrics["clip_high"] = low_counts, high_counts
        if inputs.dual_clip is not None:
            metrics["clip_dual"] = dual_count
        if need_grad:
            ctx.save_for_backward(coef)
        ctx.x_meta = (x.shape, x.dtype)
        return scale.reduce(acc)


def _as_input(grad: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """A flat gradient in the input's shape and dtype; not a view when the shape already fits, so
    autograd may add a second gradient into it in place instead of allocating the sum."""
    grad = grad if grad.shape == shape else grad.view(shape)
    return grad.to(dtype)


def _token_level_loss(
    batch: TokenBatch,
    ctx: SequenceContext,
    normalisers: LossNormalisers,
    ratio: _TokenRatio,
    config: LossConfig,
    aggregation: Aggregation,
    constant_length_tokens: int,
) -> tuple[Tensor, Metrics]:
    """Shared tail of GSPO-token and GRPO: the fused clipped objective, TIS, rollout masks, metrics."""
    seq_weights, tis_metrics = _sequence_weights(batch, ctx, config)
    token_weights, token_metrics = _token_weights(batch, ctx, config)
    scale = token_scale(aggregation, ctx.total.tokens, normalisers, constant_length_tokens)
    inputs = _ClipInputs(batch, ratio, seq_weights, token_weights, config.clip_low, config.clip_high, scale, config.dual_clip_c)
    counts: Metrics = {}
    loss = _ClippedTokenLoss.apply(batch.logprobs, inputs, counts)
    seq_tokens = ctx.total.tokens.clamp(min=1.0)
    metrics = {
        "clip_low_tokens": raw(counts["clip_low"].sum()),
        "clip_high_tokens": raw(counts["clip_high"].sum()),
        "clip_low_seqs": raw((counts["clip_low"] / seq_tokens).sum()),
        "clip_high_seqs": raw((counts["clip_high"] / seq_tokens).sum()),
        "pg_loss": raw(loss),
    }
    if "clip_dual" in counts:
        metrics["clip_dual_tokens"] = raw(counts["clip_dual"])
    return loss, {**metrics, **tis_metrics, **token_metrics, **policy_metrics(batch, ctx)}


TokenWeights = Callable[[slice], Tensor]
# (log-ratio_t, A_t) on a chunk -> (objective o_t, d o_t / d log pi_theta(y_t), per-token statistic to sum)
TermKernel = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class _TermInputs:
    """What the fused per-token objective reads besides log pi_theta (all detached)."""

    batch: TokenBatch
    token_log_ratio: Tensor  # [N] masked_log_ratio values
    kernel: TermKernel
    seq_weights: Tensor | None
    token_weights: TokenWeights | None
    scale: TokenScale


class _TokenTermLoss(_SavedCoefficientLoss):
    """loss = scale-reduction of l_t = -w_t o(r_t, A_t) (0 off the mask) for a closed-form per-token
    objective o (SAPO's gate, CISPO's clipped weight), as one op like ``_ClippedTokenLoss``: the kernel
    gives o and d o / d log pi_theta(y_t) chunk by chunk, forward saves the scaled derivative (the one
    per-token tensor kept) and backward multiplies it by the incoming scalar. ``metrics["stat"]``
    receives the sum over response tokens of the kernel's statistic."""

    @staticmethod
    def forward(ctx, x: Tensor, inputs: _TermInputs, metrics: Metrics) -> Tensor:
        batch, scale = inputs.batch, inputs.scale
        seg, mask, device = batch.segments, batch.mask, batch.mask.device
        need_grad, dtype = ctx.needs_input_grad[0], compute_dtype(x, batch.old_logprobs)
        coef = torch.empty(seg.num_tokens, dtype=dtype, device=device) if need_grad else None
        acc = scale.accumulator(seg.num_seqs, dtype, device)
        stat = torch.zeros((), dtype=torch.float32, device=device)
        per_seq_scale = scale.per_seq(dtype)
        seq_adv = None if batch.advantages is None else batch.advantages.detach().to(dtype)
        for part in token_chunks(seg.num_tokens):
            ids, on = seg.seq_ids[part], mask[part]
            off = ~on
            if seq_adv is not None:
                adv = seq_adv.index_select(0, ids).masked_fill_(off, 0.0)
            else:  # a new tensor, never a view of the caller's advantages
                adv = torch.where(on, batch.token_advantages[part].detach().to(dtype), 0.0)
            # advantages off the mask may be anything, even NaN: zeroed above, and the terms below
            objective, derivative, statistic = inputs.kernel(inputs.token_log_ratio[part].to(dtype), adv)
            stat += statistic.masked_fill_(off, 0).sum(dtype=torch.float32)
            weight = None if inputs.seq_weights is None else inputs.seq_weights.index_select(0, ids).to(dtype)
            if inputs.token_weights is not None:
                token_weight = inputs.token_weights(part)
                weight = token_weight.to(dtype) if weight is None else weight.mul_(token_weight)
            objective.masked_fill_(off, 0.0).neg_()
            if weight is not None:
                objective.mul_(weight)
            scale.accumulate(acc, ids, objective)
            if need_grad:
                out = torch.neg(derivative, out=coef[part])
                if weight is not None:
                    out.mul_(weight)
                out.mul_(scale.per_token(ids, per_seq_scale)).masked_fill_(off, 0.0)
            del adv, objective, derivative, statistic, weight, off  # before the next chunk makes its own
        metrics["stat"] = stat
        if need_grad:
            ctx.save_for_backward(coef)
        ctx.x_meta = (x.shape, x.dtype)
        return scale.reduce(acc)


def _term_loss(
    batch: TokenBatch,
    ctx: SequenceContext,
    normalisers: LossNormalisers,
    config: LossConfig,
    kernel: TermKernel,
    aggregation: Aggregation,
    constant_length_tokens: int,
    stat_key: str,
) -> tuple[Tensor, Metrics]:
    """Shared tail of SAPO and CISPO: the fused per-token objective, TIS, rollout masks, metrics."""
    seq_weights, seq_metrics = _sequence_weights(batch, ctx, config)
    token_weights, token_metrics = _token_weights(batch, ctx, config)
    scale = token_scale(aggregation, ctx.total.tokens, normalisers, constant_length_tokens)
    inputs = _TermInputs(batch, ctx.token_log_ratio, kernel, seq_weights, token_weights, scale)
    out: Metrics = {}
    loss = _TokenTermLoss.apply(batch.logprobs, inputs, out)
    metrics = {"pg_loss": raw(loss), stat_key: raw(out["stat"])}
    return loss, {**metrics, **seq_metrics, **token_metrics, **policy_metrics(batch, ctx)}


def _token_weights(batch: TokenBatch, ctx: SequenceContext, config: LossConfig) -> tuple[TokenWeights | None, Metrics]:
    """Per-chunk token weights -- token-level TIS or IcePop (``validate`` forbids both), times OPSM's
    token mask under per-token advantages -- and their metrics."""
    rc, parts, metrics = config.rollout_correction, [], {}
    if config.tis_mode == "token":
        cap = config.tis_cap
        parts.append(lambda part: token_tis_weights(batch, cap, part))
        metrics.update(_token_tis_metrics(batch, cap))
    elif rc.icepop:
        low, high = rc.icepop_low, rc.icepop_high
        parts.append(lambda part: icepop_weights(batch, low, high, part))
        metrics.update(icepop_metrics(batch, low, high, token_chunks(batch.segments.num_tokens)))
    if rc.opsm and batch.advantages is None:
        divergent = opsm_divergent(ctx.total, rc.opsm_delta)
        parts.append(lambda part: opsm_token_keep(batch, divergent, part))
        with torch.no_grad():  # as a sequence fraction: each sequence adds the share of its tokens dropped
            dropped = torch.zeros(batch.segments.num_seqs, device=batch.mask.device)
            for part in token_chunks(batch.segments.num_tokens):
                off = opsm_token_keep(batch, divergent, part).eq(0).logical_and_(batch.mask[part])
                dropped.index_add_(0, batch.segments.seq_ids[part], off.to(torch.float32))
        metrics["rc_opsm_masked"] = raw((dropped / ctx.total.tokens.clamp(min=1.0)).sum())
    if not parts:
        return None, metrics
    if len(parts) == 1:
        return parts[0], metrics
    first, second = parts
    return (lambda part: first(part) * second(part)), metrics


def _token_tis_metrics(batch: TokenBatch, tis_cap: float) -> Metrics:
    """Sum of the token-level TIS weights over response tokens and how many hit the cap (chunk by chunk)."""
    with torch.no_grad():
        weight_sum = torch.zeros((), device=batch.mask.device)
        truncated = torch.zeros((), device=batch.mask.device)
        for part in token_chunks(batch.segments.num_tokens):
            weights, on = token_tis_weights(batch, tis_cap, part), batch.mask[part]
            weight_sum += weights.masked_fill_(~on, 0.0).sum()
            truncated += weights.ge(tis_cap).logical_and_(on).sum()
    return {"tis_token_weight_sum": raw(weight_sum), "tis_token_truncated": raw(truncated)}


def _check_sequence_mean(algorithm: str, config: LossConfig) -> None:
    """GSPO's objectives (Eq. 5, 13) and SAPO's are means over sequences; another aggregation would be
    ignored silently."""
    if config.aggregation != "seq_mean_token_mean":
        raise ValueError(f"{algorithm}: aggregation={config.aggregation!r} applies to grpo and cispo only; "
                         f"{algorithm} is always a mean over sequences (seq_mean_token_mean)")


def _sequence_weights(batch: TokenBatch, ctx: SequenceContext, config: LossConfig) -> tuple[Tensor | None, Metrics]:
    """[S] detached per-sequence weights: sequence-level TIS times the rollout-correction masks (MIS,
    OPSM), or None when all are off; and their metrics."""
    weights, metrics = _tis(batch, ctx, config.tis_mode, config.tis_cap)
    keep, mask_metrics = sequence_keep(ctx.total, batch.advantages, config.rollout_correction, ctx.share())
    if keep is not None:
        weights = keep if weights is None else weights * keep
    return weights, {**metrics, **mask_metrics}


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
        adv_min, adv_max = _masked_min(adv, has_tokens), _masked_max(adv, has_tokens)
        zero_seq = adv == 0
    else:  # per token, chunk by chunk
        seg, mask = batch.segments, batch.mask
        adv_sum, adv_sq_sum = torch.zeros((), device=mask.device), torch.zeros((), device=mask.device)
        adv_min, adv_max = torch.full((), float("inf"), device=mask.device), torch.full((), float("-inf"), device=mask.device)
        nonzero = torch.zeros(seg.num_seqs, dtype=torch.float32, device=mask.device)
        for part in token_chunks(seg.num_tokens):
            on = mask[part]
            adv = torch.where(on, batch.token_advantages[part].detach().to(torch.float32), 0.0)
            adv_sum += adv.sum()
            adv_sq_sum += torch.dot(adv, adv)
            adv_min = torch.minimum(adv_min, _masked_min(adv, on))
            adv_max = torch.maximum(adv_max, _masked_max(adv, on))
            nonzero.index_add_(0, seg.seq_ids[part], adv.ne(0).to(torch.float32))
        zero_seq = has_tokens & (nonzero == 0)
    return {
        "adv_sum": raw(adv_sum),
        "adv_sq_sum": raw(adv_sq_sum),
        "adv_min": raw(adv_min),
        "adv_max": raw(adv_max),
        "zero_adv_seqs": raw((zero_seq * share).sum()),
    }


def _token_ratio_metrics(token_log_ratio: Tensor, mask: Tensor) -> Metrics:
    """Sum, min and max of pi_theta / pi_old and the sum of |log-ratio| over response tokens, chunk by chunk.

    The ratio sum is taken over ratio - 1, which is 0 off the mask (log-ratio 0 there), plus the token
    count; min and max are taken on the log-ratio and exponentiated once.
    """
    device = token_log_ratio.device
    abs_sum, excess = torch.zeros((), device=device), torch.zeros((), device=device)
    low, high = torch.full((), float("inf"), device=device), torch.full((), float("-inf"), device=device)
    for part in token_chunks(token_log_ratio.numel()):
        log_r, on = token_log_ratio[part], mask[part]
        abs_sum += torch.linalg.vector_norm(log_r, ord=1)
        low = torch.minimum(low, _masked_min(log_r, on))
        high = torch.maximum(high, _masked_max(log_r, on))
        excess += log_r.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp_().sub_(1.0).sum()
    empty = mask.sum() == 0
    return {
        "abs_log_ratio_sum": raw(abs_sum),
        "token_ratio_sum": raw(excess + mask.sum()),
        "token_ratio_min": raw(torch.where(empty, float("inf"), low.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp())),
        "token_ratio_max": raw(torch.where(empty, float("-inf"), high.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp())),
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


def _at_least_one(count: float | Tensor) -> float | Tensor:
    """A normaliser, with 0 (an empty mini-batch) read as 1 so the loss is 0 rather than NaN."""
    if isinstance(count, Tensor):
        return count.clamp(min=1.0)
    return max(float(count), 1.0)
