"""Synthetic tasks: deterministic generation, disjoint splits, and a checker that accepts exactly the
right answers."""
from __future__ import annotations

import pytest

from gspo_megatron.rewards.synthetic import (TaskSpec, check_answer, final_answer, generate, make_splits, sft_pairs,
                                             synthetic_reward)

TASKS = ["arithmetic", "sort", "countdown"]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("difficulty", [1, 3, 5])
def test_generation_is_deterministic_and_unique(task, difficulty):
    spec = TaskSpec(task, difficulty)
    a, b = generate(spec, 40, seed=7), generate(spec, 40, seed=7)
    assert a == b
    assert generate(spec, 40, seed=8) != a
    assert len({p.prompt for p in a}) == 40


@pytest.mark.parametrize("task", TASKS)
def test_reference_answers_score_one(task):
    for p in generate(TaskSpec(task, 4), 50, seed=1):
        sample = {"answer": p.answer, "meta": p.meta}
        assert synthetic_reward(sample, p.answer + "<|im_end|>").reward == 1.0, p


def test_difficulty_changes_the_problems():
    easy = generate(TaskSpec("arithmetic", 1), 20, seed=0)
    hard = generate(TaskSpec("arithmetic", 4), 20, seed=0)
    assert max(len(p.prompt) for p in easy) <= 4  # "9+9="
    assert max(len(p.prompt) for p in hard) > 6
    assert all("-" in p.prompt or "+" in p.prompt for p in hard)


def test_splits_are_disjoint_and_sft_pairs_match():
    splits = make_splits(TaskSpec("arithmetic", 2), num_train=300, num_eval=50, num_sft=200, seed=3)
    prompts = [{p.prompt for p in s} for s in (splits.train, splits.eval, splits.sft)]
    assert [len(s) for s in prompts] == [300, 50, 200]
    assert not (prompts[0] & prompts[1]) and not (prompts[1] & prompts[2]) and not (prompts[0] & prompts[2])
    pairs = sft_pairs(splits.sft)
    assert pairs[0] == (splits.sft[0].prompt, splits.sft[0].answer)
    assert eval(pairs[0][0].rstrip("=")) == int(pairs[0][1])


def test_too_small_a_problem_space_is_an_error():
    with pytest.raises(ValueError, match="too few distinct problems"):
        generate(TaskSpec("arithmetic", 1), 150, seed=0)  # only 100 single-digit sums exist
    with pytest.raises(ValueError, match="difficulty"):
        TaskSpec("sort", 9)


def test_checker_wrong_and_malformed():
    arith = {"task": "arithmetic"}
    assert check_answer(arith, "19", "19") is True
    assert check_answer(arith, "19", "18") is False
    assert check_answer(arith, "19", "nineteen") is None
    assert final_answer("  19\nbecause 12+7") == "19"
    assert synthetic_reward({"answer": "19", "meta": arith}, "19 is it").tags == ("malformed",)
    sort = {"task": "sort"}
    assert check_answer(sort, "1 2 3", "1 2 3") and not check_answer(sort, "1 2 3", "3 2 1")
    countdown = {"task": "countdown", "numbers": [3, 5, 7], "target": 22}
    assert check_answer(countdown, "3*5+7", "7+5*3") is True  # any valid expression counts
    assert check_answer(countdown, "3*5+7", "(7-5)*11") is False  # 11 is not one of the numbers
    assert check_answer(countdown, "3*5+7", "3*5+7+0") is False  # extra number
    assert check_answer(countdown, "3*5+7", "3*5") is False  # missing number
    assert check_answer(countdown, "3*5+7", "__import__('os')") is None
    assert check_answer(countdown, "3*5+7", "3**5") is None
    with pytest.raises(ValueError, match="meta"):
        synthetic_reward({"answer": "1"}, "1")
