"""Byte sizes as a user types them (``80GiB``, ``80 GB``) and as they are shown (GiB, MiB...).

One parser for every command line and config: a size needs its unit, since a bare ``80``
(bytes, or GB?) has cost users a run (`pipesim sweep --memory-limit 80` once meant 80 bytes),
and it must be positive, finite and at least a byte; ``Gb`` / ``Mb`` (bits, as network speeds
are written) are refused rather than read as bytes. Numbers given from Python (``int`` /
``float``) are bytes.
"""
from __future__ import annotations

import argparse
import math
import re

# The byte units, defined here once and imported wherever a size is scaled or shown.
KiB, MiB, GiB, TiB = 2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40
KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12

_UNITS = {"b": 1, "kb": KB, "mb": MB, "gb": GB, "tb": TB,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
UNITS_HELP = "decimal B, kB, MB, GB, TB or binary KiB, MiB, GiB, TiB"


def parse_bytes(text: "str | float | int") -> float:
    """Bytes in ``text`` (a number with its unit: decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB,
    or B), or a Python number of bytes; ValueError naming the text and the units accepted
    when the unit is missing or unknown, or the size is not > 0."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            missing = match is not None and not unit
            raise ValueError(f"memory size {text!r}: "
                             + ("a size needs its unit" if missing else "not a size")
                             + f", e.g. 80GiB or 80GB (units: {UNITS_HELP})")
        written = match.group(2)
        if len(written) > 1 and written.endswith("b") and written != written.lower():
            # Gb, Mb, Kb: bits by convention (network speeds); a memory size is in bytes
            raise ValueError(f"memory size {text!r}: {written!r} is bits; write "
                             f"{match.group(1)}{written[:-1].upper()}B for bytes (units: "
                             f"{UNITS_HELP})")
        value = float(match.group(1)) * _UNITS[unit]
    if not value > 0:
        raise ValueError(f"memory size {text!r}: must be > 0 (e.g. 80GiB)")
    if not math.isfinite(value):
        raise ValueError(f"memory size {text!r}: must be finite (e.g. 80GiB)")
    if value < 1:
        raise ValueError(f"memory size {text!r}: less than one byte (e.g. 80GiB)")
    return value


def bytes_arg(text: str) -> float:
    """`parse_bytes` as an argparse ``type``: its message becomes the usage error."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_unit(peak: float) -> tuple[float, str]:
    """(scale, name) to show byte counts up to ``peak``: GiB, MiB, KiB or bytes."""
    return next(((size, name) for size, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))
                 if peak >= size), (1.0, "bytes"))


def format_bytes(nbytes: float) -> str:
    """A byte count for people: ``9.54 MiB``, ``51.2 GiB``, ``512 bytes`` (never ``1e+07``)."""
    scale, name = byte_unit(abs(float(nbytes)))
    return f"{nbytes / scale:.3g} {name}" if scale > 1 else f"{nbytes:.4g} bytes"


def format_count(n: float) -> str:
    """A count for people: ``70.6B``, ``41.9M``, ``181k``, ``12`` (never ``0.000181B``)."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.3g}"


def format_number(x: float, *, zero_below: float = 0.0) -> str:
    """``x`` to 6 significant digits, rounding-noise (``|x| <= zero_below``) shown as ``0``."""
    return "0" if abs(x) <= zero_below else f"{x:.6g}"


def column_decimals(values, significant: int = 4, least: int = 3) -> int:
    """Decimals one column of numbers is printed with: enough for its smallest non-zero value
    to show ``significant`` digits, ``least`` at the least (7.189, 7.600 and 24.940 in one
    column, not 7.189, 7.6 and 24.94; 0.01450 when a step takes 14.5 ms)."""
    small = [abs(v) for v in values if v and math.isfinite(v)]
    if not small:
        return least
    return max(least, significant - 1 - math.floor(math.log10(min(small))))
