"""The one error type of the converters: bad input, named by file, key or field."""
from __future__ import annotations


class ConversionError(ValueError):
    """A checkpoint, config or layout cannot be converted; the message names the file, key or field."""


def name_list(names, limit: int = 12) -> str:
    """``names`` sorted and shortened for an error message: 'a, b, c (+40 more)'."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def read_json(path) -> object:
    """The JSON document in ``path``; a malformed one is a ConversionError naming the file and line."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.read())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    except UnicodeDecodeError as err:
        raise ConversionError(f"{path}: not UTF-8 (byte 0x{err.object[err.start]:02x} at offset {err.start})") from None
