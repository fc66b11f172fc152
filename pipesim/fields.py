"""Reading a value back from its JSON object: the checks every ``from_dict`` shares.

`known_fields`: every key is a field. `typed_fields`: that, and every value of the JSON type
its field needs. JSON's types are not Python's: ``true`` is not the integer 1 (Python's bool is
an int), ``1.0`` is not an integer, the string ``"false"`` is not a boolean (Python's
``bool("false")`` is True) and ``NaN`` is no number (JSON has none; Python's reader lets it
through). A value of the wrong type is refused naming the field, the type it needs and the type
it got, instead of being read as something else. `json_value` checks one value (a
config.json's keys, which are no dataclass's fields).
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

# a field's annotation (as written: the modules use ``from __future__ import annotations``) ->
# the JSON kind its value must be; annotations not listed (a nested value) are not checked here
_KINDS = {"int": "int", "bool": "bool", "str": "str", "float": "number", "tuple": "array",
          "dict": "object", "'str | Schedule'": "schedule", "str | Schedule": "schedule"}
_NEEDS = {"int": "an integer", "bool": "true or false (a JSON boolean)", "str": "a string",
          "number": "a finite number", "array": "a JSON array", "object": "a JSON object",
          "schedule": "a schedule name (a string) or a schedule object"}


def json_type(value: Any) -> str:
    """What a JSON value is, in words, as a message about it needs it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "not a finite number"
        return "a number with a fraction part" if value != int(value) else \
            "a number written with a decimal point, not an integer"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _is(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "number":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if kind == "array":
        return isinstance(value, (list, tuple))
    if kind == "object":
        return isinstance(value, dict)
    if kind == "schedule":
        return isinstance(value, (str, dict)) or type(value).__name__ == "Schedule"
    raise ValueError(f"unknown JSON kind {kind!r}")


def json_value(value: Any, kind: str, name: str, source: str,
               error: type[Exception] = ValueError, *, optional: bool = False,
               low: float | None = None, strict: bool = False) -> Any:
    """``value`` itself once it is of JSON ``kind`` (int, bool, str, number, array, object;
    ``optional``: or null) and, for numbers, at least ``low`` (above it with ``strict``);
    otherwise ``error`` naming ``source``, field ``name``, what it needs and what it got."""
    if value is None and optional:
        return value
    if not _is(value, kind):
        extra = " or null" if optional else ""
        raise error(f"{source}: {name} must be {_NEEDS[kind]}{extra}, got {value!r} "
                    f"({json_type(value)})")
    if low is not None and (value <= low if strict else value < low):
        raise error(f"{source}: {name} must be {'>' if strict else '>='} {low:g}, got {value!r}")
    return value


def known_fields(cls: type, data: Any, what: str, source: str,
                 error: type[Exception] = ValueError) -> dict:
    """``data`` itself, once it is a JSON object whose keys are all fields of dataclass ``cls``;
    otherwise ``error`` naming ``source``, the unknown keys and the known ones (``what`` names
    the value in the message: "model", "CostModel", ...)."""
    if not isinstance(data, dict):
        raise error(f"{source}: {what} is a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise error(f"{source}: unknown {what} field(s) {', '.join(unknown)}; "
                    f"known: {', '.join(sorted(known))}")
    return data


def typed_fields(cls: type, data: Any, what: str, source: str,
                 error: type[Exception] = ValueError, *, kinds: dict[str, str] | None = None
                 ) -> dict:
    """`known_fields`, and every value of the JSON type its field's annotation says (``int``,
    ``bool``, ``str``, ``float``: a finite number, ``tuple``: an array; ``X | None``: or
    null); ``kinds``: field -> JSON kind where the stored form is not the annotation's (a
    tuple of pairs stored as an object). Fields of other types (a nested value) are left to
    their own reader."""
    known_fields(cls, data, what, source, error)
    for f in fields(cls):
        if f.name not in data:
            continue
        annotation = str(f.type).strip()
        optional = annotation.endswith("| None")
        kind = _KINDS.get(annotation[:-len("| None")].strip() if optional else annotation)
        kind = (kinds or {}).get(f.name, kind)
        if kind is not None:
            name = f.name if source.endswith(what) else f"{what}.{f.name}"
            json_value(data[f.name], kind, name, source, error, optional=optional)
    return data
