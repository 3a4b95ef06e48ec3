"""What a verifier returns. Kept tiny and import-free so reward workers start fast."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One response's reward from one verifier.

    reward: the score (built-in verifiers: in [0, 1]).
    tags: short names of notable outcomes ("no_answer", "timeout", ...); the pool counts them per term
        in the step metrics as ``rewards/<term>/<tag>``.
    correct: the verifier's own verdict on whether the answer is right (accuracy, eval pass@1 / pass@k);
        None when the verifier gives only a score (a plain float): then a response is correct when it
        scores the top of the term's declared ``range`` (docs/rewards.md, "Correctness").
    """

    reward: float
    tags: tuple[str, ...] = ()
    correct: bool | None = None


class RewardSetupError(RuntimeError):
    """A reward term cannot be built (bad import path, not callable, a model folder refused, ...): raised at
    start-up."""


def sample_mapping(sample: Any) -> Mapping[str, Any]:
    """The dict form of a prompt sample that verifiers read (``answer``, ``tests``, ``meta``, ...).

    Accepts a mapping, or a dataclass such as ``gspo_megatron.data.PromptSample`` (converted with
    ``dataclasses.asdict`` so no data-module import is needed here)."""
    if isinstance(sample, Mapping):
        return sample
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return dataclasses.asdict(sample)
    raise TypeError(f"a prompt sample must be a mapping or a dataclass, got {type(sample).__name__}")
