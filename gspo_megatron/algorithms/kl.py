"""Per-token estimators of KL(pi_theta || pi_ref) from log-probs of the sampled tokens (Schulman's k1-k3).

With log r_t = log pi_ref(y_t) - log pi_theta(y_t) and y_t sampled from (approximately) pi_theta:

* k1 = -log r                 unbiased, can be negative, high variance;
* k2 = (log r)^2 / 2          biased, always >= 0, low variance;
* k3 = r - 1 - log r          unbiased, always >= 0, low variance (the common default).

The paper trains GSPO without a KL term and its first author recommends coefficient 0; it is offered
for experiments and as a metric (``kl_mean``) whenever reference log-probs are given.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gspo_megatron.algorithms.sequences import LOG_RATIO_LIMIT, masked_log_ratio


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: Literal["k1", "k2", "k3"]) -> Tensor:
    """[N] per-token KL estimate on response tokens, 0 elsewhere; differentiable in ``logprobs``.

    The exponent of k3 is clamped to LOG_RATIO_LIMIT so that r never overflows.
    """
    log_r = masked_log_ratio(ref_logprobs, logprobs, mask)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        return torch.exp(log_r.clamp(max=LOG_RATIO_LIMIT)) - 1.0 - log_r
    raise ValueError(f"kl_estimator: must be one of k1, k2, k3, got {estimator!r}")
