"""Resolve configured reward terms to callables, and evaluate one task of a term.

This module is what a reward worker runs; it is also used in-process when ``num_workers: 0``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import math
import traceback
from typing import Any, Callable, Mapping, Sequence

from gspo_megatron.rewards.config import RewardConfig, RewardTermConfig
from gspo_megatron.rewards.in_process import InProcessLimits, RewardInterrupted
from gspo_megatron.rewards.types import RewardSetupError, Verdict

Item = tuple[Mapping[str, Any], str]  # (prompt sample as a dict, response text)
# the largest |reward| a term may return: the advantages square the centred rewards in float32
# (max ~3.4e38), so 1e15 leaves room for any group size; larger is an error (scored 0, counted)
MAX_REWARD_MAGNITUDE = 1e15


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One response's result for one term: a Verdict, or an error message (scored 0, counted)."""

    verdict: Verdict | None
    error: str | None = None
    timed_out: bool = False
    out_of_range: bool = False  # the reward lay outside the term's declared range (RewardTermConfig.range)
    # an error's traceback, headed by where the term's function is defined (the user's file and line even
    # when our check of its return value raised); the trainer writes each term's first to the run folder
    traceback: str | None = None


@dataclasses.dataclass
class Term:
    key: str
    weight: float
    fn: Callable[..., Any]
    is_async: bool
    batched: bool


def import_failure(err: BaseException) -> str:
    """``Type: message (file:line)`` of an error raised while importing a user's module, at the user's line: a
    SyntaxError's own file and line (its traceback ends in the import machinery, ``<frozen importlib...>``),
    else the deepest frame outside the import machinery."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"{type(err).__name__}: {err.msg} ({err.filename}:{err.lineno})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen ")]
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{at}"


def import_function(path: str, where: str, import_dirs: Sequence[str] = ()) -> Callable[..., Any]:
    """``module:function`` imported with ``import_dirs`` first on the import path (rewards.import_dirs)."""
    import sys

    for folder in reversed(import_dirs):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        looked = f" (looked in {', '.join(import_dirs)} and the Python path)" if import_dirs else ""
        raise RewardSetupError(f"{where}: cannot import module {module_name!r}: {err}{looked}") from err
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing: name it and where
        raise RewardSetupError(f"{where}: importing {module_name!r} failed: {import_failure(err)}") from err
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardSetupError(f"{where}: {module_name!r} has no callable {attr!r}")
    return fn


def build_term(term: RewardTermConfig, cfg: RewardConfig, where: str) -> Term:
    if term.name == "math":
        import math_verify  # noqa: F401  (load sympy now, not on the first response's clock)

        from gspo_megatron.rewards.math import math_reward

        fn: Callable[..., Any] = functools.partial(math_reward, cfg=cfg.math)
    elif term.name == "code":
        from gspo_megatron.rewards.code import code_reward

        fn = functools.partial(code_reward, cfg=cfg.code)
    elif term.name == "synthetic":
        from gspo_megatron.rewards.synthetic import synthetic_reward

        fn = synthetic_reward
    elif term.name == "reward_model":
        from gspo_megatron.rewards.scoring_models import RewardModelTerm  # torch: only where a model scores

        return Term(term.metric_key, term.weight, RewardModelTerm(term.reward_model, f"{where}.reward_model"),
                    False, True)
    elif term.name == "judge":
        from gspo_megatron.rewards.scoring_models import JudgeTerm

        return Term(term.metric_key, term.weight, JudgeTerm(term.judge, f"{where}.judge"), False, True)
    else:
        fn = import_function(term.name, f"{where}.name", cfg.import_dirs)
    # a callable object with ``async def __call__`` counts as async too
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    return Term(term.metric_key, term.weight, fn, is_async, term.batched)


def build_terms(cfg: RewardConfig, where: str = "rewards") -> list[Term]:
    return [build_term(t, cfg, f"{where}.terms[{i}]") for i, t in enumerate(cfg.terms)]


def _as_verdict(value: Any) -> Verdict:
    if isinstance(value, Verdict):
        verdict = value
    elif isinstance(value, (bool, int, float)):
        verdict = Verdict(float(value))
    else:
        raise TypeError(f"a reward function must return a number, got {type(value).__name__}")
    if not math.isfinite(verdict.reward):
        raise ValueError(f"a reward function returned {verdict.reward}")
    if abs(verdict.reward) > MAX_REWARD_MAGNITUDE:
        raise ValueError(f"a reward function returned {verdict.reward:g}, beyond +-{MAX_REWARD_MAGNITUDE:g} "
                         "(the group advantages are float32: a larger reward overflows them to NaN)")
    return verdict


def defined_at(fn: Callable[..., Any]) -> str:
    """``file:line`` of a term's function (partials and callable objects unwrapped), or its repr."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__call__
    code = getattr(inspect.unwrap(target), "__code__", None)  # builtins and C functions have none
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)


def _error(err: BaseException, term: Term) -> Outcome:
    """The error outcome of ``term`` on one response: the message (500 characters) and the traceback."""
    name = getattr(term.fn, "__qualname__", term.fn)
    where = f"term {term.key!r}: function {name!r} defined at {defined_at(term.fn)}"
    text = "".join(traceback.format_exception(err))
    return Outcome(None, f"{type(err).__name__}: {err}"[:500], traceback=f"{where}\n{text}"[-20000:])


async def _one_async(term: Term, item: Item, timeout_s: float) -> Outcome:
    try:
        return Outcome(_as_verdict(await asyncio.wait_for(term.fn(*item), timeout_s)))
    except asyncio.TimeoutError:
        return Outcome(None, f"timed out after {timeout_s} s", timed_out=True)
    except Exception as err:  # a failing reward scores 0 and is counted, it never stops training
        return _error(err, term)


async def _many_async(term: Term, items: Sequence[Item], timeout_s: float) -> list[Outcome]:
    return list(await asyncio.gather(*(_one_async(term, item, timeout_s) for item in items)))


def _value_outcome(value: Any, term: Term) -> Outcome:
    """One response's outcome from a batched term's value: an Exception instance in the returned list fails
    that response alone (scored 0, counted: a judge's unparsed verdict), anything else is a reward."""
    if isinstance(value, Exception):
        return _error(value, term)
    try:
        return Outcome(_as_verdict(value))
    except (TypeError, ValueError) as err:
        return _error(err, term)


def _batched(term: Term, items: Sequence[Item], timeout_s: float, limits: InProcessLimits | None) -> list[Outcome]:
    samples, responses = [s for s, _ in items], [r for _, r in items]
    try:
        if term.is_async:
            values = asyncio.run(asyncio.wait_for(term.fn(samples, responses), timeout_s * len(items)))
        elif limits is not None:
            values = limits.call(term.fn, (samples, responses), timeout_s * len(items))
        else:
            values = term.fn(samples, responses)
        values = list(values)
        if len(values) != len(items):
            raise ValueError(f"batched reward returned {len(values)} values for {len(items)} responses")
        return [_value_outcome(v, term) for v in values]
    except asyncio.TimeoutError:
        return [Outcome(None, "batch timed out", timed_out=True)] * len(items)
    except RewardInterrupted as err:
        return [Outcome(None, f"batch {err}", timed_out=True)] * len(items)
    except Exception as err:  # the whole batch scores 0 and is counted
        return [_error(err, term)] * len(items)


def evaluate(term: Term, items: Sequence[Item], timeout_s: float,
             limits: InProcessLimits | None = None) -> list[Outcome]:
    """Run ``term`` on ``items``. Exceptions become error outcomes; async calls get ``timeout_s`` each.
    Synchronous calls: in a worker, no timeout here (the pool enforces it by killing the worker); in the
    calling process (``limits``, num_workers: 0) a deadline and the stop signals (rewards/in_process.py)."""
    if term.batched:
        return _batched(term, items, timeout_s, limits)
    if term.is_async:
        return asyncio.run(_many_async(term, items, timeout_s))
    outcomes = []
    for item in items:
        try:
            value = term.fn(*item) if limits is None else limits.call(term.fn, item, timeout_s)
            outcomes.append(Outcome(_as_verdict(value)))
        except RewardInterrupted as err:
            outcomes.append(Outcome(None, f"{err} (after up to {timeout_s:g} s, in process)", timed_out=True))
        except Exception as err:  # a failing reward scores 0 and is counted, it never stops training
            outcomes.append(_error(err, term))
    return outcomes


__all__ = ["Item", "Outcome", "RewardSetupError", "Term", "build_term", "build_terms", "defined_at", "evaluate",
           "import_function"]
