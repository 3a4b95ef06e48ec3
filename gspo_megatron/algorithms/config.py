"""The loss section of the config: which policy objective, its clip range, KL, entropy, TIS, advantages.

Built from YAML with ``typed_config.build(LossConfig, mapping, "loss")``. Unset clip bounds take the
paper's values for the chosen algorithm (GSPO: 3e-4 / 4e-4; GRPO: 0.2 / 0.27), filled in at
construction so the saved resolved config shows the numbers actually used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from gspo_megatron.algorithms.advantages import AdvantageEstimator
from gspo_megatron.algorithms.kl import KLEstimator
from gspo_megatron.algorithms.rollout_correction import RolloutCorrectionConfig
from gspo_megatron.typed_config import check

Algorithm = Literal["gspo", "gspo_token", "grpo", "sapo", "cispo"]
Aggregation = Literal["seq_mean_token_mean", "token_mean", "token_sum"]
TISMode = Literal["none", "sequence", "token"]
DistillEstimator = Literal["k1", "k3"]

# (clip_low, clip_high) from the paper: GSPO section 5.1; GRPO baseline with "clip-higher". The only copy:
# the losses take them from a LossConfig, never from defaults of their own. SAPO has no clip (its soft
# gate replaces it). CISPO clips its detached importance weight to [1 - clip_low, 1 + clip_high]:
# MiniMax-M1 (arXiv 2506.13585) imposes no lower bound (clip_low = 1: the bound 0 is never
# reached) and does not publish its upper one; 1 + 4 = 5 is ScaleRL's epsilon_max (arXiv 2510.13786).
PAPER_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27), "sapo": (None, None), "cispo": (1.0, 4.0)}
# The aggregation each algorithm's paper uses where ``aggregation`` is unset; CISPO's objective divides
# by the group's total token count (MiniMax-M1), the others are means over sequences.
PAPER_AGGREGATION = {"cispo": "token_mean"}
# Algorithms whose per-token terms ``aggregation`` may reduce; the GSPO family and SAPO are always means
# over sequences (GSPO Eq. 5, 13; the SAPO objective).
TOKEN_AGGREGATED = ("grpo", "cispo")
# Algorithms with a hard clip of the ratio, where dual clip applies.
HARD_CLIPPED = ("gspo", "gspo_token", "grpo")


@dataclass
class DistillConfig:
    """On-policy distillation (``losses.distill_penalty``; docs/algorithms.md, "On-policy distillation").

    teacher_dir: a Hugging Face folder or one of our checkpoint folders (converted or training) of a model
                 with the student's tokenizer and vocabulary, any supported family and shape; null = off;
    coef:        weight of the per-token reverse-KL term KL(pi_theta || pi_teacher) in the loss (> 0 when
                 teacher_dir is set);
    estimator:   k1 (default): d_t = log pi_theta(y_t) - log pi_teacher(y_t) as a detached per-token
                 penalty on log pi_theta, whose expected gradient is the per-token reverse-KL gradient;
                 k3: r - 1 - log r with r = pi_teacher / pi_theta as a loss (its expected gradient is that
                 of the forward KL(pi_teacher || pi_theta));
    only:        pure distillation: the policy-gradient (GSPO) term leaves the loss (still logged).
    """

    teacher_dir: str | None = None
    coef: float = 1.0
    estimator: DistillEstimator = "k1"
    only: bool = False

    @property
    def enabled(self) -> bool:
        return self.teacher_dir is not None

    def validate(self, path: str) -> None:
        check(self.estimator in ("k1", "k3"), f"{path}.estimator", f"must be k1 or k3, got {self.estimator!r}")
        check(math.isfinite(self.coef) and self.coef >= 0.0, f"{path}.coef", f"must be >= 0, got {self.coef}")
        if self.teacher_dir is not None:
            check(self.coef > 0.0, f"{path}.coef", "must be > 0 when distill.teacher_dir is set (0 would load a "
                  "teacher for nothing: unset teacher_dir to turn distillation off)")
        check(not self.only or self.teacher_dir is not None, f"{path}.only",
              "pure distillation needs a teacher: set distill.teacher_dir")


@dataclass
class LossConfig:
    """algorithm:            gspo (Eq. 5-7), gspo_token (Eq. 13-17), grpo (token-level, Eq. 2), sapo (soft
                             gate, arXiv 2511.20347) or cispo (clipped IS weight, arXiv 2506.13585);
    clip_low, clip_high:     the ratio is clipped to [1 - clip_low, 1 + clip_high]; null = paper value
                             (unused by sapo);
    aggregation:             grpo and cispo: seq_mean_token_mean | token_mean | token_sum (Dr. GRPO,
                             divides by num_seqs * constant_length_tokens); null = the paper's
                             (cispo: token_mean, else seq_mean_token_mean); GSPO and SAPO are always
                             means over sequences;
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
    advantage_estimator, advantage_eps, advantage_batch_norm: see ``advantages.group_advantages``;
    sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for A > 0 and A <= 0 (paper: 1.0, 1.05);
    dual_clip_c:             dual clip (Ye et al., arXiv 1912.09729): the loss of an A < 0 term is at
                             most c |A| (c > 1; null = off); gspo, gspo_token and grpo;
    rollout_correction:      masks for the train/rollout mismatch (``rollout_correction.py``).
    """

    algorithm: Algorithm = "gspo"
    clip_low: float | None = None
    clip_high: float | None = None
    aggregation: Aggregation | None = None
    constant_length_tokens: int = 0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    tis_mode: TISMode = "none"
    tis_cap: float = 2.0
    advantage_estimator: AdvantageEstimator = "grpo"
    advantage_eps: float = 1e-6
    advantage_batch_norm: bool = False
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dual_clip_c: float | None = None
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        default_low, default_high = PAPER_CLIP.get(self.algorithm, (None, None))
        if self.clip_low is None:
            self.clip_low = default_low
        if self.clip_high is None:
            self.clip_high = default_high
        if self.aggregation is None:
            self.aggregation = PAPER_AGGREGATION.get(self.algorithm, "seq_mean_token_mean")

    def validate(self, path: str) -> None:
        check(self.algorithm in PAPER_CLIP, f"{path}.algorithm", f"must be one of {sorted(PAPER_CLIP)}, got {self.algorithm!r}")
        if self.algorithm != "sapo":
            # CISPO may drop its lower bound (clip_low = 1: the weight is never raised)
            top = 1.0 if self.algorithm == "cispo" else math.nextafter(1.0, 0.0)
            check(
                self.clip_low is not None and math.isfinite(self.clip_low) and 0.0 < self.clip_low <= top,
                f"{path}.clip_low",
                f"must be in (0, 1{']' if self.algorithm == 'cispo' else ')'} so that 1 - clip_low >= 0, got {self.clip_low}",
            )
            check(self.clip_high is not None and math.isfinite(self.clip_high) and self.clip_high > 0.0,
                  f"{path}.clip_high", f"must be > 0, got {self.clip_high}")
        check(
            self.algorithm in TOKEN_AGGREGATED or self.aggregation == "seq_mean_token_mean",
            f"{path}.aggregation",
            f"applies to {' and '.join(TOKEN_AGGREGATED)} only; {self.algorithm} is always a mean over sequences (seq_mean_token_mean)",
        )
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0.0, f"{path}.{name}", f"must be > 0, got {value}")
        if self.dual_clip_c is not None:
            check(self.algorithm in HARD_CLIPPED, f"{path}.dual_clip_c",
                  f"applies to the hard-clipped losses ({', '.join(HARD_CLIPPED)}), not {self.algorithm}")
            check(math.isfinite(self.dual_clip_c) and self.dual_clip_c > 1.0, f"{path}.dual_clip_c",
                  f"must be > 1, got {self.dual_clip_c}")
        self.rollout_correction.check_with(self.algorithm, self.tis_mode, f"{path}.rollout_correction")
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
