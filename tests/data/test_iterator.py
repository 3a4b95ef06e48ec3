"""Resumable, deterministic prompt iteration."""
from __future__ import annotations

import pytest

from gspo_megatron.data import PromptDataset, PromptIterator, PromptSample


def _dataset(n: int, tag: str = "") -> PromptDataset:
    samples = [PromptSample(index=i, prompt_ids=[i], prompt_text=f"{tag}{i}", prompt=f"{tag}{i}", messages=None,
                            answer=f"{tag}{i}", tests=None, meta={}, source=f"x:{i + 1}") for i in range(n)]
    return PromptDataset("train", samples, {})


def _indices(batches):
    return [[s.index for s in b] for b in batches]


def test_every_step_has_prompts_per_step_and_each_epoch_covers_the_data():
    it = PromptIterator(_dataset(10), prompts_per_step=4, seed=1)
    steps = _indices(next(it) for _ in range(5))  # 20 prompts = 2 epochs
    assert all(len(s) == 4 for s in steps)
    flat = [i for s in steps for i in s]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new permutation each epoch
    assert flat[:10] != list(range(10))
    assert (it.epoch, it.offset, it.steps) == (1, 10, 5)  # the next epoch starts lazily on the next draw


def test_order_depends_only_on_seed():
    a = _indices(next(PromptIterator(_dataset(30), 8, seed=5)) for _ in range(1))
    b = _indices(next(PromptIterator(_dataset(30), 8, seed=5)) for _ in range(1))
    c = _indices(next(PromptIterator(_dataset(30), 8, seed=6)) for _ in range(1))
    assert a == b and a != c
    unshuffled = PromptIterator(_dataset(5), 3, shuffle=False)
    assert _indices([next(unshuffled), next(unshuffled)]) == [[0, 1, 2], [3, 4, 0]]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 7])
def test_resume_continues_exactly_where_it_stopped(stop_after):
    reference = PromptIterator(_dataset(11), prompts_per_step=3, seed=9)
    expected = _indices(next(reference) for _ in range(10))
    first = PromptIterator(_dataset(11), prompts_per_step=3, seed=9)
    seen = _indices(next(first) for _ in range(stop_after))
    state = first.state_dict()
    resumed = PromptIterator(_dataset(11), prompts_per_step=3, seed=9)  # a fresh process after a restart
    resumed.load_state_dict(state)
    seen += _indices(next(resumed) for _ in range(10 - stop_after))
    assert seen == expected
    assert resumed.steps == 10


def test_resume_refuses_other_data_or_order():
    state = PromptIterator(_dataset(11), 3, seed=9).state_dict()
    with pytest.raises(ValueError, match="num_prompts is 11 in the checkpoint but 12 now"):
        PromptIterator(_dataset(12), 3, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint"):
        PromptIterator(_dataset(11, tag="other"), 3, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="seed is 9 in the checkpoint but 10 now"):
        PromptIterator(_dataset(11), 3, seed=10).load_state_dict(state)
