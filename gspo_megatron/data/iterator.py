"""Deterministic, resumable iteration over training prompts: ``prompts_per_step`` prompts per step.

Epoch ``e`` visits the dataset in the order ``permutation(seed, e)`` (numpy PCG64, identical on every
machine and rank); a step that crosses the end of an epoch takes the rest of it and continues in the
next, so every step has exactly ``prompts_per_step`` prompts and every prompt is seen once per epoch.
The position (epoch, offset) is the whole state: ``state_dict()`` into the checkpoint,
``load_state_dict()`` after a restart continues with the very next prompt.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from gspo_megatron.data.dataset import PromptDataset, PromptSample
from gspo_megatron.data.readers import DatasetError


class PromptIterator(Iterator[list[PromptSample]]):
    def __init__(self, dataset: PromptDataset, prompts_per_step: int, seed: int = 0, shuffle: bool = True):
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.dataset = dataset
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # prompts of the current epoch already drawn
        self.steps = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> list[PromptSample]:
        batch = []
        while len(batch) < self.prompts_per_step:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_step - len(batch), len(self._order) - self.offset)
            batch.extend(self.dataset[int(i)] for i in self._order[self.offset:self.offset + take])
            self.offset += take
        self.steps += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "steps": self.steps, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self.dataset), "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; refuses a state saved for other data or another order."""
        for key, mine in (("num_prompts", len(self.dataset)), ("fingerprint", self.dataset.fingerprint),
                          ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise DatasetError(f"prompt iterator state: {key} is {state[key]!r} in the checkpoint but {mine!r} "
                                 "now; resuming would not continue the same prompt order")
        self.epoch, self.offset, self.steps = int(state["epoch"]), int(state["offset"]), int(state["steps"])
        self._order = self._epoch_order(self.epoch)


__all__ = ["PromptIterator"]
