"""Math answers: extract the final answer from a response and compare it with the ground truth.

Extraction (first method that finds something, in the configured order):
  ``boxed``       the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces, nested ok);
  ``answer_is``   the last "the answer is X" / "answer: X" (to the end of its line);
  ``last_number`` the last number in the text (integers, decimals, ``a/b``, ``1,234``, ``12%``).

Comparison goes through math-verify (sympy): fractions, decimals, LaTeX (``\\frac``, ``\\sqrt``,
``\\dfrac``), sets/intervals, equations ``x = 3`` vs ``3``, percentages ``12\\%`` = 0.12, and units /
``\\text{cm}`` / ``\\$`` stripped. A percentage also matches its bare number ("50%" vs gold "50").
"""
from __future__ import annotations

import dataclasses
import re
import threading
from functools import lru_cache
from typing import Any, Literal, Mapping

from gspo_megatron.rewards.types import Verdict
from gspo_megatron.typed_config import check

ExtractMethod = Literal["boxed", "answer_is", "last_number"]


@dataclasses.dataclass
class MathRewardConfig:
    """reward = (1 - format_weight) * correct + format_weight * [response matches format_regex]."""

    extract: list[ExtractMethod] = dataclasses.field(default_factory=lambda: ["boxed", "answer_is", "last_number"])
    format_regex: str | None = None
    format_weight: float = 0.0
    verify_timeout_s: int = 5  # math-verify's own SIGALRM limit per parse/verify (whole seconds)

    def validate(self, path: str) -> None:
        check(len(self.extract) > 0, f"{path}.extract", "needs at least one method")
        check(0.0 <= self.format_weight <= 1.0, f"{path}.format_weight", "must be in [0, 1]")
        check(self.format_weight == 0.0 or self.format_regex is not None, f"{path}.format_regex",
              "is required when format_weight > 0")
        if self.format_regex is not None:
            try:
                re.compile(self.format_regex)
            except re.error as err:
                check(False, f"{path}.format_regex", f"is not a valid regular expression: {err}")
        check(self.verify_timeout_s >= 1, f"{path}.verify_timeout_s", "must be >= 1")


_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS = re.compile(r"(?i)\banswer\s*(?:is|:|=)\s*:?\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?|-?\d+(?:\.\d+)?(?:/\d+)?%?|-?\.\d+%?")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}; ``\\boxed 5`` (no braces) gives the next token."""
    for match in reversed(list(_BOX.finditer(text))):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
            continue  # unbalanced (truncated response): try an earlier box
        token = re.match(r"[^\s$]+", text[i:])
        if token:
            return token.group(0)
    return None


def _strip_wrapping(answer: str) -> str:
    answer = answer.strip()
    for _ in range(3):
        before = answer
        answer = answer.strip().strip("*").strip()  # markdown bold
        if len(answer) >= 2 and answer[0] == answer[-1] == "$":
            answer = answer.strip("$").strip()
        if answer.startswith("\\(") and answer.endswith("\\)"):
            answer = answer[2:-2].strip()
        answer = answer.rstrip(".,;").rstrip()  # sentence punctuation ("The answer is 5.")
        if answer == before:
            break
    return answer


def extract_answer(text: str, methods: list[ExtractMethod] | tuple[str, ...] = ("boxed", "answer_is", "last_number")) -> str | None:
    """The final answer in ``text`` by the first method that finds one, or None."""
    for method in methods:
        if method == "boxed":
            found = _last_boxed(text)
        elif method == "answer_is":
            matches = _ANSWER_IS.findall(text)
            found = (_last_boxed(matches[-1]) or matches[-1]) if matches else None
        elif method == "last_number":
            numbers = _NUMBER.findall(text)
            found = numbers[-1] if numbers else None
        else:
            raise ValueError(f"unknown extraction method {method!r}")
        if found is not None:
            found = _strip_wrapping(found)
            if found:
                return found
    return None


def _alarm_seconds(cfg_seconds: int) -> int | None:
    # math-verify's timeouts use SIGALRM, which Python allows only in the main thread.
    return cfg_seconds if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse(expr: str, timeout_s: int | None) -> tuple[Any, ...]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    latex = expr.replace("%", "\\%").replace("\\\\%", "\\%")
    parsed = parse(f"${latex}$", extraction_config=configs, parsing_timeout=timeout_s)
    if not parsed:
        parsed = parse(expr, extraction_config=configs, parsing_timeout=timeout_s)
    return tuple(parsed)


def _variants(answer: str) -> list[str]:
    """The answer, and without its percent sign ("50%" may be graded against gold "50")."""
    bare = re.sub(r"\s*\\?%$", "", answer)
    return [answer] if bare == answer else [answer, bare]


def answers_equivalent(gold: str, predicted: str, timeout_s: int | None = 5) -> bool:
    """Symbolic equivalence of two answer strings (LaTeX or plain) via math-verify."""
    from math_verify import verify

    if gold.strip() == predicted.strip():
        return True
    for g in _variants(gold):
        gold_parsed = _parse(g, timeout_s)
        if not gold_parsed:
            continue
        for p in _variants(predicted):
            pred_parsed = _parse(p, timeout_s)
            if pred_parsed and verify(list(gold_parsed), list(pred_parsed), timeout_seconds=timeout_s):
                return True
    return False


def math_reward(sample: Mapping[str, Any], response: str, cfg: MathRewardConfig | None = None) -> Verdict:
    """Reward in [0, 1] for ``response`` against ``sample["answer"]`` (a string or number)."""
    cfg = cfg or MathRewardConfig()
    gold = sample.get("answer")
    if gold is None or isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        raise ValueError(f"math reward needs sample['answer'] as a string or number, got {gold!r}")
    tags = []
    predicted = extract_answer(response, cfg.extract)
    if predicted is None:
        tags.append("no_answer")
        correct = 0.0
    else:
        correct = float(answers_equivalent(str(gold), predicted, _alarm_seconds(cfg.verify_timeout_s)))
        if correct:
            tags.append("correct")
    reward = correct
    if cfg.format_regex is not None:
        formatted = re.search(cfg.format_regex, response) is not None
        if not formatted:
            tags.append("bad_format")
        reward = (1.0 - cfg.format_weight) * correct + cfg.format_weight * float(formatted)
    return Verdict(reward, tuple(tags), correct=bool(correct))


__all__ = ["MathRewardConfig", "answers_equivalent", "extract_answer", "math_reward"]
