"""The loss section of the config: which policy objective, its clip range, KL, entropy, TIS, advantages.

Built from YAML with ``typed_config.build(LossConfig, mapping, "loss")``. Unset clip bounds take the
paper's values for the chosen algorithm (GSPO: 3e-4 / 4e-4; GRPO: 0.2 / 0.27), filled in at
construction so the saved resolved config shows the numbers actually used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gspo_megatron.algorithms.advantages import AdvantageEstimator
from gspo_megatron.algorithms.kl import KLEstimator
from gspo_megatron.typed_config import check

Algorithm = Literal["gspo", "gspo_token", "grpo"]
Aggregation = Literal["seq_mean_token_mean", "token_mean", "token_sum"]
TISMode = Literal["none", "sequence", "token"]

# (clip_low, clip_high) from the paper: GSPO section 5.1; GRPO baseline with "clip-higher". The only copy:
# the losses take them from a LossConfig, never from defaults of their own.
PAPER_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


@dataclass
class LossConfig:
    """algorithm:            gspo (Eq. 5-7), gspo_token (Eq. 13-17) or grpo (token-level, Eq. 2);
    clip_low, clip_high:     the ratio is clipped to [1 - clip_low, 1 + clip_high]; null = paper value;
    aggregation:             grpo only: seq_mean_token_mean | token_mean | token_sum (Dr. GRPO, divides
                             by num_seqs * constant_length_tokens); GSPO is always a mean over sequences;
    constant_length_tokens:  the constant length of token_sum (e.g. the maximum response length);
    kl_coef, kl_estimator:   KL(pi_theta || pi_ref) penalty weight (0 = off) and its estimator (k3, the
                             default, is unbiased in value, not in gradient: as a loss its expected
                             gradient is that of KL(pi_ref || pi_theta); k2's is that of KL(pi_theta ||
                             pi_ref); see kl.py);
    entropy_coef:            entropy bonus weight (0 = off);
    tis_mode, tis_cap:       truncated importance sampling for the train/inference mismatch, weight
                             min(pi_old / pi_rollout, tis_cap) per token, or per sequence as the
                             *geometric* mean of the token ratios (``sequence``: length-normalised, the
                             "geometric" sequence TIS of the literature, not the product of the ratios);
    advantage_estimator, advantage_eps, advantage_batch_norm: see ``advantages.group_advantages``.
    """

    algorithm: Algorithm = "gspo"
    clip_low: float | None = None
    clip_high: float | None = None
    aggregation: Aggregation = "seq_mean_token_mean"
    constant_length_tokens: int = 0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    tis_mode: TISMode = "none"
    tis_cap: float = 2.0
    advantage_estimator: AdvantageEstimator = "grpo"
    advantage_eps: float = 1e-6
    advantage_batch_norm: bool = False

    def __post_init__(self) -> None:
        default_low, default_high = PAPER_CLIP.get(self.algorithm, (None, None))
        if self.clip_low is None:
            self.clip_low = default_low
        if self.clip_high is None:
            self.clip_high = default_high

    def validate(self, path: str) -> None:
        check(self.algorithm in PAPER_CLIP, f"{path}.algorithm", f"must be one of {sorted(PAPER_CLIP)}, got {self.algorithm!r}")
        check(
            math.isfinite(self.clip_low) and 0.0 < self.clip_low < 1.0,
            f"{path}.clip_low",
            f"must be in (0, 1) so that 1 - clip_low > 0, got {self.clip_low}",
        )
        check(math.isfinite(self.clip_high) and self.clip_high > 0.0, f"{path}.clip_high", f"must be > 0, got {self.clip_high}")
        check(
            self.algorithm == "grpo" or self.aggregation == "seq_mean_token_mean",
            f"{path}.aggregation",
            f"applies to grpo only; {self.algorithm} is always a mean over sequences (seq_mean_token_mean)",
        )
        check(
            self.aggregation != "token_sum" or self.constant_length_tokens >= 1,
            f"{path}.constant_length_tokens",
            f"token_sum divides by a constant length: set it >= 1 (e.g. the maximum response length), got {self.constant_length_tokens}",
        )
        check(self.constant_length_tokens >= 0, f"{path}.constant_length_tokens", f"must be >= 0, got {self.constant_length_tokens}")
        check(math.isfinite(self.kl_coef) and self.kl_coef >= 0.0, f"{path}.kl_coef", f"must be >= 0, got {self.kl_coef}")
        check(
            math.isfinite(self.entropy_coef) and self.entropy_coef >= 0.0,
            f"{path}.entropy_coef",
            f"must be >= 0, got {self.entropy_coef}",
        )
        check(math.isfinite(self.tis_cap) and self.tis_cap > 0.0, f"{path}.tis_cap", f"must be > 0, got {self.tis_cap}")
        check(
            not (self.algorithm == "gspo" and self.tis_mode == "token"),
            f"{path}.tis_mode",
            "token-level weights need per-token loss terms; with gspo use tis_mode: sequence, or algorithm: gspo_token",
        )
        check(
            math.isfinite(self.advantage_eps) and self.advantage_eps > 0.0,
            f"{path}.advantage_eps",
            f"must be > 0, got {self.advantage_eps}",
        )
