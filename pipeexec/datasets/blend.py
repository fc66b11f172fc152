"""Weighted blending of several corpora, as Megatron-Core's ``BlendedDataset``: sample ``i``
of the blend comes from the corpus whose share so far lags its weight the most
(``build_blending_indices`` in Megatron's helpers.cpp, ties to the first corpus), and is that
corpus's next unused sample. The assignment of the first ``n`` samples does not depend on the
blend's length, so a longer run only appends.

``--data-path`` spells a blend as Megatron's ``get_blend_from_list`` reads it: prefixes alone,
or weight / prefix pairs (`parse_data_path`)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Megatron's mid_level_dataset_surplus: each corpus builds this fraction more samples than its
# weighted share, so the greedy assignment never asks one for a sample past its end
SURPLUS = 0.005


class BlendError(ValueError):
    pass


def parse_data_path(items: Sequence[str]) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """(prefixes, weights or None) from ``--data-path`` items: ``P1 P2 ...`` or ``W1 P1 W2 P2
    ...``. Weights must be finite, >= 0 and not all 0 (they are normalised later)."""
    if isinstance(items, str) or not all(isinstance(i, str) for i in items):
        raise BlendError(f"--data-path: give its items as text (prefixes, weights), got "
                         f"{items!r}")
    items = list(items)
    if not items:
        raise BlendError("--data-path: give one or more corpus prefixes (PREFIX for PREFIX.bin "
                         "and PREFIX.idx), or weight / prefix pairs")
    numbers = [_number(i) for i in items]
    if not any(n is not None for n in numbers):
        return tuple(items), None
    pairs = len(items) % 2 == 0 and all(numbers[k] is not None and numbers[k + 1] is None
                                        for k in range(0, len(items), 2))
    if not pairs:
        raise BlendError(
            f"--data-path {' '.join(items)}: give either prefixes only (P1 P2 ...) or weight / "
            f"prefix pairs (W1 P1 W2 P2 ...); got {len(items)} item(s) mixing numbers and "
            "names otherwise")
    weights = tuple(numbers[k] for k in range(0, len(items), 2))
    prefixes = tuple(items[k + 1] for k in range(0, len(items), 2))
    for w, p in zip(weights, prefixes):
        if not math.isfinite(w) or w < 0:
            raise BlendError(f"--data-path: the weight of {p} is {w:g}; weights must be finite "
                             "and >= 0")
    if not sum(weights) > 0:
        raise BlendError(f"--data-path: every weight is 0 ({' '.join(items)}); give at least one "
                         "corpus a positive weight")
    return prefixes, weights  # type: ignore[return-value]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def normalize(weights: Sequence[float]) -> list[float]:
    """Megatron's ``normalize``: weights / their sum, in float64."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def target_sizes(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Megatron's ``_get_size_per_split_per_dataset`` for one split: ``ceil(ceil(size * w) *
    (1 + surplus))`` samples per corpus."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(corpus of each sample int16, the sample's index in that corpus int64): Megatron's
    greedy, error-minimising ``build_blending_indices``, the same double arithmetic (about
    0.3 s of CPU a million samples for two corpora)."""
    from array import array

    w = [float(x) for x in weights]
    counts = [0] * len(w)
    corpus, within = array("h"), array("q")
    add_corpus, add_within = corpus.append, within.append
    others = range(1, len(w))
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, w[0] * x - counts[0]
        for k in others:
            err = w[k] * x - counts[k]
            if err > best_err:
                best, best_err = k, err
        add_corpus(best)
        add_within(counts[best])
        counts[best] += 1
    return (np.frombuffer(corpus, dtype=np.int16).copy() if size else np.zeros(0, np.int16),
            np.frombuffer(within, dtype=np.int64).copy() if size else np.zeros(0, np.int64))


class BlendedSamples:
    """``size`` samples drawn from ``datasets`` by ``weights`` (normalised); ``ds[i]`` is a
    sample of one of them."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        self.datasets, self.weights = list(datasets), normalize(weights)
        self.corpus, self.within = blending_indices(self.weights, size)
        counts = np.bincount(self.corpus, minlength=len(self.datasets))
        for k, (ds, c) in enumerate(zip(self.datasets, counts)):
            if c > len(ds):
                raise BlendError(f"the blend asks corpus {k} for {int(c)} samples, it has "
                                 f"{len(ds)}")

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        return self.datasets[int(self.corpus[i])][int(self.within[i])]


def fitting_size(weights: Sequence[float], lengths: Sequence[int]) -> int:
    """The longest blend whose greedy assignment asks no corpus for more samples than it has
    (a blend of one epoch of each, for a split whose sample count is not given)."""
    w = normalize(weights)
    upper = int(min(n / x for n, x in zip(lengths, w) if x > 0)) + 1
    corpus, within = blending_indices(w, upper)
    over = np.nonzero(within >= np.asarray(lengths)[corpus])[0]
    return int(over[0]) if len(over) else upper
