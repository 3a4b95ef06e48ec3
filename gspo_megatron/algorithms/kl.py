"""Per-token estimators of KL(pi_theta || pi_ref) from log-probs of the sampled tokens (Schulman's k1-k3).

With log r_t = log pi_ref(y_t) - log pi_theta(y_t) and y_t sampled from (approximately) pi_theta:

* k1 = -log r                 unbiased, can be negative, high variance;
* k2 = (log r)^2 / 2          biased, always >= 0, low variance;
* k3 = r - 1 - log r          unbiased in value, always >= 0, low variance (the common default).

Unbiased in value, not in gradient: used as a loss term (samples fixed, differentiated through
log pi_theta), the expected gradient of k1 is 0, that of k3 is the gradient of the *reverse* KL(pi_ref ||
pi_theta), and only k2's is the gradient of KL(pi_theta || pi_ref). All three are exact as metrics.

The paper trains GSPO without a KL term and its first author recommends coefficient 0; it is offered
for experiments and as a metric (``kl_mean``) whenever reference log-probs are given.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gspo_megatron.algorithms.sequences import (
    LOG_RATIO_LIMIT,
    log_ratio_values,
    masked_log_ratio,
)

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator) -> Tensor:
    """[N] per-token KL estimate on response tokens, 0 elsewhere; differentiable in ``logprobs``.

    The exponent of k3 is clamped to LOG_RATIO_LIMIT so that r never overflows.
    """
    _check(estimator)
    return _kl_from_log_r(masked_log_ratio(ref_logprobs, logprobs, mask), estimator)


def kl_values_and_derivative(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator, *, with_derivative: bool
) -> tuple[Tensor, Tensor | None]:
    """``kl_estimate`` without autograd, and (optionally) its elementwise derivative d kl_t / d logprobs_t.

    For whole tensors or chunks (the fused KL term in ``losses`` recomputes the derivative in backward).
    With log r = ref - logprobs (masked, clamped to +-TOKEN_LOG_RATIO_LIMIT; d log r / d logprobs = -1
    where ``log_ratio_values`` keeps it, else 0):
        k1: d/d logprobs = 1;   k2: -log r;   k3: 1 - r [log r <= LOG_RATIO_LIMIT]   (times keep).
    """
    _check(estimator)
    log_r, keep = log_ratio_values(ref_logprobs, logprobs.detach(), mask, with_keep=with_derivative)
    derivative = None
    if with_derivative:
        if estimator == "k1":
            derivative = keep.to(log_r.dtype)
        elif estimator == "k2":
            derivative = torch.where(keep, -log_r, 0.0)
        else:  # the exponent's clamp passes the gradient of r up to and including the limit, like torch.clamp
            r = log_r.clamp(max=LOG_RATIO_LIMIT).exp_().masked_fill_(log_r.gt(LOG_RATIO_LIMIT), 0.0)
            derivative = r.neg_().add_(1.0).masked_fill_(~keep, 0.0)
    return _kl_from_log_r(log_r, estimator), derivative


def _kl_from_log_r(log_r: Tensor, estimator: KLEstimator) -> Tensor:
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    return torch.exp(log_r.clamp(max=LOG_RATIO_LIMIT)) - 1.0 - log_r


def _check(estimator: str) -> None:
    if estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"kl_estimator: must be one of k1, k2, k3, got {estimator!r}")
