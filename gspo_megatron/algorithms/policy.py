"""The one loss entry point the trainer calls: ``policy_loss(config, batch, normalisers)``, and the table
``POLICY_LOSSES`` from ``loss.algorithm`` to its policy loss (one signature for all)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from gspo_megatron.algorithms.config import DistillConfig, LossConfig
from gspo_megatron.algorithms.layout import LossNormalisers, TokenBatch
from gspo_megatron.algorithms.losses import (
    cispo_loss,
    distill_penalty,
    entropy_bonus,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    kl_penalty,
    sapo_loss,
)
from gspo_megatron.algorithms.metrics import raw
from gspo_megatron.algorithms.sequences import ReduceSequenceSums, SequenceContext, sequence_context

PolicyLossFn = Callable[[TokenBatch, LossNormalisers, LossConfig, SequenceContext], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """fn:            (batch, normalisers, config, context) -> (loss, raw metrics);
    sequence_grad: the loss differentiates through the per-sequence log-ratio sums (GSPO, Eq. 7), so the
                   context keeps their graph; the token-level losses have their own fused op and need none.
    """

    fn: PolicyLossFn
    sequence_grad: bool


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "gspo": PolicyLoss(gspo_loss, sequence_grad=True),
    "gspo_token": PolicyLoss(gspo_token_loss, sequence_grad=False),
    "grpo": PolicyLoss(grpo_loss, sequence_grad=False),
    "sapo": PolicyLoss(sapo_loss, sequence_grad=False),
    "cispo": PolicyLoss(cispo_loss, sequence_grad=False),
}


def policy_loss(
    config: LossConfig,
    batch: TokenBatch,
    normalisers: LossNormalisers,
    reduce_sequence_sums: ReduceSequenceSums | None = None,
    distill: DistillConfig | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = policy loss + kl_coef * KL + distill.coef * distill - entropy_coef * entropy, and the raw
    metrics of all four; with ``distill.only`` the policy loss leaves the sum (its metrics stay).

    normalisers:          global counts of the whole mini-batch (see ``LossNormalisers``);
    reduce_sequence_sums: context parallelism only: all-reduce of the per-sequence sums over the CP
                          group (see ``sequences``); None means each sequence is whole on this rank.
    distill:              on-policy distillation (``losses.distill_penalty``): needs the batch's
                          ``teacher_logprobs`` when ``distill.enabled``.
    The KL (or entropy) metric is reported whenever the batch has ``ref_logprobs`` (``entropy``), and
    enters the loss only when its coefficient is non-zero.
    """
    distilling = distill is not None and distill.enabled
    if config.algorithm not in POLICY_LOSSES:
        raise ValueError(f"loss.algorithm: must be one of {', '.join(POLICY_LOSSES)}, got {config.algorithm!r}")
    policy = POLICY_LOSSES[config.algorithm]
    # pure distillation: the policy term is computed for its metrics only, without a graph
    with torch.set_grad_enabled(torch.is_grad_enabled() and not (distilling and distill.only)):
        ctx = sequence_context(batch, reduce_sequence_sums, differentiable=policy.sequence_grad)
        pg_loss, metrics = policy.fn(batch, normalisers, config, ctx)

    loss = pg_loss.new_zeros(()) if distilling and distill.only else pg_loss
    aggregate = {
        "aggregation": config.aggregation,
        "constant_length_tokens": config.constant_length_tokens,
        "seq_tokens": ctx.total.tokens,
    }
    if config.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("loss.kl_coef: is > 0 but the batch has no ref_logprobs (reference-model log-probs)")
    if batch.ref_logprobs is not None:
        with torch.set_grad_enabled(torch.is_grad_enabled() and config.kl_coef > 0):
            kl, kl_metrics = kl_penalty(batch, normalisers, estimator=config.kl_estimator, **aggregate)
        metrics.update(kl_metrics)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
    if distilling:
        if batch.teacher_logprobs is None:
            raise ValueError("distill.teacher_dir: is set but the batch has no teacher_logprobs (teacher log-probs)")
        distill_loss, distill_metrics = distill_penalty(batch, normalisers, estimator=distill.estimator, **aggregate)
        metrics.update(distill_metrics)
        loss = loss + distill.coef * distill_loss
    if config.entropy_coef > 0 and batch.entropy is None:
        raise ValueError("loss.entropy_coef: is > 0 but the batch has no entropy (per-token entropy of pi_theta)")
    if batch.entropy is not None:
        with torch.set_grad_enabled(torch.is_grad_enabled() and config.entropy_coef > 0):
            entropy, entropy_metrics = entropy_bonus(batch, normalisers, **aggregate)
        metrics.update(entropy_metrics)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * entropy
    metrics["loss"] = raw(loss)
    return loss, metrics
