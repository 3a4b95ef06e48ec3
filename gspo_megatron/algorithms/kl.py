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


def distill_values_and_derivative(
    logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, estimator: str, *, with_derivative: bool
) -> tuple[Tensor, Tensor | None]:
    """[N] per-token distillation term on response tokens (0 elsewhere) and its surrogate derivative
    g_t = d loss_t / d logprobs_t used in backward; no autograd (``losses.distill_penalty`` fuses it).

    With d_t = log pi_theta(y_t) - log pi_teacher(y_t) (masked, clamped to +-TOKEN_LOG_RATIO_LIMIT) and
    y_t sampled from pi_theta, so that E[d_t] is the per-token reverse KL(pi_theta || pi_teacher):
        k1: value d_t,                  g_t = d_t        (d_t detached: loss_t = sg[d_t] log pi_theta(y_t);
            E[g_t grad log pi_theta] is the gradient of the reverse KL at token t, Agarwal et al. 2024);
        k3: value r - 1 - log r,        g_t = 1 - r      (r = exp(-d_t); the k3 of ``kl_values_and_derivative``
            with the teacher as reference: reverse KL in value, forward KL(pi_teacher || pi_theta) in gradient).
    A teacher equal to the student gives d_t = 0: value 0 and g_t = 0 for both.
    """
    if estimator not in ("k1", "k3"):
        raise ValueError(f"distill.estimator: must be k1 or k3, got {estimator!r}")
    if estimator == "k3":
        return kl_values_and_derivative(logprobs, teacher_logprobs, mask, "k3", with_derivative=with_derivative)
    d, keep = log_ratio_values(logprobs.detach(), teacher_logprobs, mask, with_keep=with_derivative)
    return d, (torch.where(keep, d, 0.0) if with_derivative else None)
