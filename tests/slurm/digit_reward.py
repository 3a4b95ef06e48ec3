"""A reward with spread on an untrained model, for the short multi-node runs: the sort task's reward is
0 for every response of a barely warmed-up policy, so every advantage is 0, every gradient is 0, and
comparing two layouts' metrics would compare zeros. Used as ``rewards.terms=[{name: tests.slurm.digit_reward:digit_fraction}]``."""
from __future__ import annotations

from typing import Any, Mapping

from gspo_megatron.rewards.types import Verdict


def digit_fraction(sample: Mapping[str, Any], response: str) -> Verdict:
    """The fraction of the response's non-space characters that are digits (0 for an empty response)."""
    chars = [c for c in response if not c.isspace()]
    score = sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
    return Verdict(score, correct=score == 1.0)  # accuracy: responses of digits only
