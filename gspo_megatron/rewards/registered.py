"""Reward functions handed to ``gspo_megatron.api.train`` as Python callables, importable by name.

The reward pool imports a custom term ``module:function`` (``rewards/terms.py import_function``); the term
``gspo_megatron.rewards.registered:NAME`` finds here the callable registered as ``NAME`` in this process.
A callable defined in a notebook cannot be imported by a fresh worker interpreter, so such terms run in the
training process (``rewards.num_workers: 0``, which ``api.train`` sets).
"""
from __future__ import annotations

import keyword
from typing import Any, Callable

MODULE = __name__
_FUNCTIONS: dict[str, Callable[..., Any]] = {}


def register(name: str, fn: Callable[..., Any]) -> str:
    """Registers ``fn`` as ``name`` (a Python identifier; a later registration of the name replaces it, as a
    notebook cell that redefines a function would) and returns its term name ``module:name``."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"reward name {name!r}: must be a Python identifier")
    if not callable(fn):
        raise TypeError(f"reward {name!r}: {type(fn).__name__} is not callable")
    _FUNCTIONS[name] = fn
    return f"{MODULE}:{name}"


def __getattr__(name: str) -> Callable[..., Any]:
    """``getattr(module, NAME)``: the registered callable (PEP 562 module attribute)."""
    if name in _FUNCTIONS:
        return _FUNCTIONS[name]
    raise AttributeError(f"no reward function registered as {name!r} in this process (registered: "
                         f"{sorted(_FUNCTIONS) or 'none'}; gspo_megatron.api.train registers them)")


__all__ = ["MODULE", "register"]
