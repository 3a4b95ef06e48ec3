"""Reward functions written for TRL's GRPOTrainer, ``f(prompts, completions, **kwargs) -> list[float]``,
as gspo-megatron batched terms ``f(samples, responses) -> list[float]``.

In a reward module beside the config::

    from gspo_megatron.rewards.trl import from_trl
    from my_trl_project import accuracy_reward      # def accuracy_reward(prompts, completions, answer, **kw)

    accuracy = from_trl(accuracy_reward)

and in the config: ``rewards.terms: [{name: my_rewards:accuracy, batched: true}]``.

What the function receives, as TRL passes it for a standard (non-conversational) dataset: ``prompts`` the
prompt strings (the row's ``prompt``; for chat rows, its ``messages``), ``completions`` the response
texts, and one keyword list per other column of the row (``answer``, ``tests`` and each ``meta`` key);
``completion_ids`` is not passed (text only). ``None`` returned for a response (TRL: "not applicable")
scores 0 here, like an error.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

_OWN_FIELDS = ("index", "prompt_ids", "prompt_text", "prompt", "messages", "source", "meta")


def trl_arguments(samples: Sequence[Mapping[str, Any]], responses: Sequence[str]) -> tuple[list, list[str], dict]:
    """(prompts, completions, column keyword lists) of a batch, as TRL passes them to a reward function."""
    prompts = [s.get("prompt") if s.get("prompt") is not None else s.get("messages") for s in samples]
    columns: dict[str, list] = {}
    keys = [k for k in samples[0] if k not in _OWN_FIELDS] if samples else []
    for key in keys:
        columns[key] = [s.get(key) for s in samples]
    for key in sorted({k for s in samples for k in (s.get("meta") or {})}):
        columns.setdefault(key, [(s.get("meta") or {}).get(key) for s in samples])
    return prompts, list(responses), columns


def from_trl(fn: Callable[..., Sequence[float | None]]) -> Callable[[Sequence[Mapping], Sequence[str]], list[float]]:
    """A batched term (``batched: true``) calling the TRL-style ``fn``; the length must match."""

    @functools.wraps(fn)
    def term(samples: Sequence[Mapping[str, Any]], responses: Sequence[str]) -> list[float]:
        prompts, completions, columns = trl_arguments(samples, responses)
        values = list(fn(prompts=prompts, completions=completions, **columns))
        if len(values) != len(completions):
            raise ValueError(f"{getattr(fn, '__name__', fn)}: returned {len(values)} rewards for {len(completions)} "
                             f"completions")
        return [0.0 if v is None else float(v) for v in values]

    return term


__all__ = ["from_trl", "trl_arguments"]
