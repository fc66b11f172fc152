"""``--split 969,30,1``: the train / validation / test shares of every corpus, cut by document
as Megatron-Core does (``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix``,
and the builder's ``round(share * documents)`` bookends): each split is one contiguous range of
a corpus's documents (its sequences), train first."""
from __future__ import annotations

import math

SPLITS = ("train", "validation", "test")
DEFAULT_SPLIT = "969,30,1"          # Megatron's --split default


class SplitError(ValueError):
    pass


def parse_split(text: str) -> tuple[float, float, float]:
    """``"98,2,0"`` -> (0.98, 0.02, 0.0): up to three non-negative numbers, comma separated,
    missing ones 0, normalised to sum 1. SplitError names what does not parse."""
    if not isinstance(text, str):
        raise SplitError(f"--split must be text such as '98,2,0', got {text!r}")
    items = [t.strip() for t in text.split(",")]
    if not 1 <= len(items) <= 3:
        raise SplitError(f"--split {text!r}: give 1 to 3 comma-separated shares (train, "
                         "validation, test), e.g. 98,2,0")
    values = []
    for item in items:
        try:
            v = float(item)
        except ValueError:
            raise SplitError(f"--split {text!r}: {item!r} is not a number (e.g. 98,2,0)") from None
        if not math.isfinite(v) or v < 0:
            raise SplitError(f"--split {text!r}: shares must be finite and >= 0, got {item}")
        values.append(v)
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise SplitError(f"--split {text!r}: the shares sum to 0; give at least the train share "
                         "(e.g. 98,2,0)")
    return tuple(v / total for v in values)  # type: ignore[return-value]


def split_ranges(shares: tuple[float, float, float], documents: int
                 ) -> tuple[tuple[int, int] | None, ...]:
    """Per split, the range ``[begin, end)`` of document indices, or None for a split of share
    0 (Megatron builds no dataset for it)."""
    bounds = [0.0]
    for s in shares:
        bounds.append(bounds[-1] + s)
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            out.append(None)
        else:
            out.append((int(round(lo * documents)), int(round(hi * documents))))
    return tuple(out)
