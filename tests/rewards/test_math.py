"""Math verifier on real examples: right, wrong, malformed, and equivalent forms."""
from __future__ import annotations

import pytest

from gspo_megatron.rewards.math import MathRewardConfig, answers_equivalent, extract_answer, math_reward


@pytest.mark.parametrize("text, expected", [
    ("so the total is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, nested braces
    ("\\boxed{\\{1, 2\\}} is the set", "\\{1, 2\\}"),
    ("Therefore, the answer is $\\dfrac{3}{4}$.", "\\dfrac{3}{4}"),
    ("Final answer: **17**", "17"),
    ("We add 3 and 4 to get 7 apples", "7"),
    ("growth of 12.5% per year", "12.5%"),
    ("about 1,234,567 people", "1,234,567"),
    ("the box is cut off \\boxed{\\frac{1", "1"),  # unbalanced box: falls back to the last number
    ("I do not know.", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("gold, predicted", [
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\dfrac12"),
    ("\\frac{3}{4}", "0.75"),
    ("0.5", "50\\%"),
    ("50%", "0.5"),
    ("50", "50%"),  # a percentage also matches its bare number
    ("5", "5\\text{ cm}"),
    ("5", "5 meters"),
    ("12", "\\$12"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("(x+1)^2", "x^2+2x+1"),
    ("3", "x = 3"),
    ("1000", "1,000"),
    ("\\{1,2\\}", "\\{2,1\\}"),
])
def test_equivalent_forms(gold, predicted):
    assert answers_equivalent(gold, predicted)


@pytest.mark.parametrize("gold, predicted", [
    ("0.5", "\\frac{1}{3}"),
    ("1/3", "0.33"),
    ("5", "6\\text{ cm}"),
    ("2\\sqrt{2}", "\\sqrt{2}"),
    ("12", "21"),
])
def test_different_answers(gold, predicted):
    assert not answers_equivalent(gold, predicted)


def test_reward_right_wrong_malformed():
    sample = {"answer": "\\frac{1}{2}"}
    assert math_reward(sample, "Half of it: \\boxed{0.5}").reward == 1.0
    assert math_reward(sample, "So \\boxed{0.25}").reward == 0.0
    none = math_reward(sample, "I cannot solve this")
    assert none.reward == 0.0 and "no_answer" in none.tags
    assert math_reward({"answer": 7}, "the answer is 7.").reward == 1.0  # numeric gold


def test_format_reward_weighting():
    cfg = MathRewardConfig(format_regex=r"^<think>.*</think>", format_weight=0.2)
    sample = {"answer": "4"}
    assert math_reward(sample, "<think>2+2</think> \\boxed{4}", cfg).reward == pytest.approx(1.0)
    assert math_reward(sample, "\\boxed{4}", cfg).reward == pytest.approx(0.8)
    assert math_reward(sample, "<think>hmm</think> \\boxed{5}", cfg).reward == pytest.approx(0.2)
    assert "bad_format" in math_reward(sample, "\\boxed{5}", cfg).tags


def test_missing_gold_is_an_error():
    with pytest.raises(ValueError, match="sample\\['answer'\\]"):
        math_reward({"answer": None}, "\\boxed{1}")
