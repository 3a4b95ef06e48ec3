"""The one error type of the converters: bad input, named by file, key or field."""
from __future__ import annotations


class ConversionError(ValueError):
    """A checkpoint, config or layout cannot be converted; the message names the file, key or field."""


def name_list(names, limit: int = 12) -> str:
    """``names`` sorted and shortened for an error message: 'a, b, c (+40 more)'."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
