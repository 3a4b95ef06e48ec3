"""Reading a generative judge's verdict: the declared rule (``JudgeConfig.pattern`` or ``labels``) applied to its
text. Pure string work, import-free, so config validation can try the rule on ``test_verdict`` at start-up."""
from __future__ import annotations

import math
import re
from typing import Any


def label_regex(labels: dict[str, float]) -> re.Pattern[str]:
    """One regex matching any label as a whole word; longer labels first, so "incorrect" is not read as
    "correct" when both are labels."""
    alternatives = "|".join(re.escape(label) for label in sorted(labels, key=len, reverse=True))
    return re.compile(rf"(?<!\w)({alternatives})(?!\w)")


def parse_verdict(judge: Any, text: str) -> float | None:
    """The score in ``text`` under ``judge``'s rule (a ``JudgeConfig``), or None when the rule finds none.

    The last match counts: a judge that reasons first states its verdict at the end. A pattern's captured
    group must read as a finite number, else there is no verdict."""
    if judge.pattern is not None:
        matches = list(re.finditer(judge.pattern, text))
        if not matches:
            return None
        try:
            value = float(matches[-1].group(1))
        except (TypeError, ValueError):  # the group did not capture a number: no verdict, not a crash
            return None
        return value if math.isfinite(value) else None
    matches = list(label_regex(judge.labels).finditer(text))
    return float(judge.labels[matches[-1].group(1)]) if matches else None


__all__ = ["label_regex", "parse_verdict"]
