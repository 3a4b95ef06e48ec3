"""Typed, nested configuration built from plain mappings (YAML), with errors that name the field.

Every config section in gspo-megatron is a frozen-free ``@dataclass`` whose fields carry type
annotations. ``build(cls, mapping, path)`` turns a mapping into that dataclass, recursing into nested
dataclass fields, checking types, rejecting unknown keys, and then calling the section's own
``validate()`` (if it defines one) so value constraints live beside the fields they constrain.

Errors are ``ConfigError("rollout.samples_per_prompt: must be >= 1, got 0")``: the dotted path of the
offending field first, so a user can find it in their YAML.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any, Literal, Mapping, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


def fail(path: str, message: str) -> None:
    raise ConfigError(f"{path}: {message}")


def unknown_field(path: str, name: str, known) -> None:
    """Refuse the unknown field ``name`` at ``path``, with the closest known name when one is near (a typo)."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    guess = f", did you mean {close[0]!r}?" if close else ""
    fail(path, f"unknown field{guess} (known fields: {sorted(known)})")


def check(condition: bool, path: str, message: str) -> None:
    """Raise ``ConfigError`` naming ``path`` when ``condition`` is false (used in ``validate()``)."""
    if not condition:
        fail(path, message)


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    origin = get_origin(annotation)
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, Mapping):
            fail(path, f"expected a mapping for section {annotation.__name__}, got {type(value).__name__}")
        return build(annotation, value, path)
    if origin is Literal:
        allowed = get_args(annotation)
        if value not in allowed:
            fail(path, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        if value is None:
            if type(None) in args:
                return None
            fail(path, "may not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:  # try the next member of the union; all failures are reported
                errors.append(str(err))
        if len(errors) == 1:  # ``X | None``: the member's own error already names its field
            raise ConfigError(errors[0])
        fail(path, "; ".join(errors))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            fail(path, f"expected a list, got {type(value).__name__}")
        (item_type, *rest) = get_args(annotation) or (Any,)
        items = [_coerce(v, item_type, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            fail(path, f"expected a mapping, got {type(value).__name__}")
        _, value_type = get_args(annotation) or (Any, Any)
        return {str(k): _coerce(v, value_type, f"{path}.{k}") for k, v in value.items()}
    if annotation is bool:
        if not isinstance(value, bool):
            fail(path, f"expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, f"expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "1e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(path, f"expected a number, got {value!r}")
        # every float setting: .inf / .nan would train to NaN weights (or skip every update) and exit 0
        if not math.isfinite(value):
            fail(path, f"must be a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            fail(path, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported annotation {annotation!r} in a config dataclass")


def build(cls: type[T], mapping: Mapping[str, Any] | None, path: str = "") -> T:
    """Build dataclass ``cls`` from ``mapping``; unknown keys and bad types raise ``ConfigError``."""
    mapping = dict(mapping or {})
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - names)
    prefix = f"{path}." if path else ""
    if unknown:
        unknown_field(f"{prefix}{unknown[0]}", unknown[0], names)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in mapping:
            kwargs[f.name] = _coerce(mapping[f.name], hints[f.name], f"{prefix}{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            fail(f"{prefix}{f.name}", "required field is missing")
    obj = cls(**kwargs)
    validate = getattr(cls, "validate", None)  # an optional hook a section may define
    if validate is not None:
        obj.validate(path or cls.__name__)
    return obj


def _section_of(annotation: Any) -> Any:
    """The dataclass a field's annotation holds (``X``, ``X | None``, ``list[X]``), else None (a leaf)."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType, list, tuple):
        sections = [s for s in map(_section_of, get_args(annotation)) if s is not None]
        return sections[0] if len(sections) == 1 else None
    return None


def _is_dict_field(annotation: Any) -> bool:
    """``dict[...]`` or ``dict[...] | None``: a field whose keys are its own (JudgeConfig.labels)."""
    if get_origin(annotation) in (Union, types.UnionType):
        return any(get_origin(a) is dict for a in get_args(annotation))
    return get_origin(annotation) is dict


def field_at(cls: type, dotted: str) -> Any:
    """The annotation of the field a dotted key (``rollout.sglang.launch.dtype``, ``rewards.terms[0].name``)
    names in the config tree ``cls``; an unknown key is a ConfigError naming its first unknown part. Keys
    below a ``dict`` field are free (its own keys), as ``build`` takes them."""
    annotation: Any = cls
    walked = ""
    for part in re.findall(r"\[\d+\]|[^.\[\]]+", dotted):
        if _is_dict_field(annotation):
            return annotation
        if part.startswith("["):  # a list item: the list's own section
            walked += part
            continue
        section = _section_of(annotation)
        if section is None:
            fail(walked, f"is a setting, not a section: it has no field {part!r}")
        hints = get_type_hints(section)
        walked += f".{part}" if walked else part
        if part not in hints:
            unknown_field(walked, part, hints)
        annotation = hints[part]
    return annotation


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config (for saving the resolved config next to a run)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


__all__ = ["ConfigError", "build", "check", "fail", "field_at", "to_dict"]
