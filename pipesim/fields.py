"""Reading a value back from its JSON object: the one check every ``from_dict`` shares."""
from __future__ import annotations

from dataclasses import fields
from typing import Any


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
