"""Memory sizes with units, as a user types them: ``80GiB``, ``80 GB``, ``141e9``."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: "str | float | int") -> float:
    """Bytes in ``text`` (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB, or a bare number of
    bytes); ValueError naming the text and the units accepted."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"memory size {text!r}: expected a number with a unit, e.g. 80GiB "
                             f"or 80GB (units: {', '.join(u for u in _UNITS if u)})")
        value = float(match.group(1)) * _UNITS[unit]
    if not value > 0:
        raise ValueError(f"memory size {text!r}: must be > 0")
    return value
