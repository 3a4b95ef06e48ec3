"""GSPO algorithm core in pure PyTorch: group advantages, GSPO / GSPO-token / GRPO / SAPO / CISPO losses, KL,
entropy, truncated importance sampling and reducible metrics. Imports nothing from Megatron or SGLang.
See docs/algorithms.md."""
from gspo_megatron.algorithms.advantages import GroupAdvantages, group_advantages, turn_ids, turn_token_advantages
from gspo_megatron.algorithms.config import PAPER_CLIP, LossConfig
from gspo_megatron.algorithms.kl import kl_estimate
from gspo_megatron.algorithms.layout import (
    LossNormalisers,
    Segments,
    TokenBatch,
    count_normalisers,
    packed_batch,
    padded_batch,
)
from gspo_megatron.algorithms.losses import (
    aggregate_token_terms,
    cispo_loss,
    clipped_objective,
    dual_clipped,
    entropy_bonus,
    grpo_loss,
    gspo_loss,
    gspo_loss_from_sums,
    gspo_token_loss,
    kl_penalty,
    sapo_loss,
)
from gspo_megatron.algorithms.metrics import DERIVED, METRICS, combine_minibatches, finalize_metrics, merge_metrics
from gspo_megatron.algorithms.policy import POLICY_LOSSES, PolicyLoss, policy_loss
from gspo_megatron.algorithms.rollout_correction import RolloutCorrectionConfig, icepop_weights, sequence_keep
from gspo_megatron.algorithms.sequences import (
    LOG_RATIO_LIMIT,
    TOKEN_LOG_RATIO_LIMIT,
    SequenceContext,
    SequenceSums,
    masked_log_ratio,
    sequence_context,
    sequence_sums,
)

__all__ = [
    "GroupAdvantages",
    "DERIVED",
    "LOG_RATIO_LIMIT",
    "LossConfig",
    "LossNormalisers",
    "METRICS",
    "PAPER_CLIP",
    "POLICY_LOSSES",
    "PolicyLoss",
    "RolloutCorrectionConfig",
    "Segments",
    "SequenceContext",
    "SequenceSums",
    "TOKEN_LOG_RATIO_LIMIT",
    "TokenBatch",
    "aggregate_token_terms",
    "cispo_loss",
    "clipped_objective",
    "combine_minibatches",
    "count_normalisers",
    "dual_clipped",
    "entropy_bonus",
    "finalize_metrics",
    "group_advantages",
    "icepop_weights",
    "turn_ids",
    "turn_token_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_loss_from_sums",
    "gspo_token_loss",
    "kl_estimate",
    "kl_penalty",
    "masked_log_ratio",
    "merge_metrics",
    "packed_batch",
    "padded_batch",
    "policy_loss",
    "sapo_loss",
    "sequence_context",
    "sequence_keep",
    "sequence_sums",
]
