"""Step metrics computed from a trace alone, so simulated and measured runs are scored alike.

Definitions (every time in seconds; "compute rows" are rows with ``kind == "compute"``):

* ``makespan``: last end minus first start over all rows of all ranks.
* ``busy[r]``: sum of the durations of rank r's compute rows; ``idle[r] = makespan - busy[r]``.
* ``bubble_fraction`` (Megatron-LM, Narayanan et al. 2021): idle time over ideal compute time,
  ``(makespan - ideal) / ideal`` with ``ideal = max_r busy[r]``, the step time of the busiest
  rank with no bubble at all. 1F1B with uniform stages: ``(p-1)/m``.
* ``span[r]``: rank r's own span, last end minus first start of its compute rows;
  ``bubble[r] = span[r] - busy[r]``, the idle time between its first and last computation.
* ``bubble_rate`` (Zero Bubble paper, Qi et al. 2024): ``1 - busy/span`` of the slowest rank,
  the rank with the largest idle share of its own span, ``max_r bubble[r] / span[r]``.
  1F1B with uniform stages: ``(p-1)/(m+p-1)``. Measuring each rank over its own span is what
  lets the paper's parallelogram schedules (ZB-H2, ZB-V), whose ranks start and end at
  staggered times, reach zero. ``bubble_time`` is that rank's ``bubble[r]``.
* ``comm_wait[r]``: time when rank r has a comm row in progress and no compute row, i.e. the
  measure of (union of its comm spans) minus (union of its compute spans).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


def makespan(trace: "pd.DataFrame") -> float:
    return float(trace["end"].max() - trace["start"].min())


def _compute_rows(trace: "pd.DataFrame") -> "pd.DataFrame":
    return trace[trace["kind"] == "compute"]


def compute_spans(trace: "pd.DataFrame") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, start, end) of the compute rows, in trace order: what `busy_of` and `span_of`
    read, so a result that has these arrays without a DataFrame scores the same."""
    rows = _compute_rows(trace)
    return (rows["rank"].to_numpy(np.int64), rows["start"].to_numpy(float),
            rows["end"].to_numpy(float))


def busy_of(rank: np.ndarray, start: np.ndarray, end: np.ndarray, ranks: int) -> list[float]:
    """``busy`` from the compute rows' arrays: per rank, the durations summed in row order."""
    return np.bincount(rank, weights=end - start, minlength=ranks)[:ranks].tolist()


def span_of(rank: np.ndarray, start: np.ndarray, end: np.ndarray, ranks: int) -> list[float]:
    """``span`` from the compute rows' arrays (0 for a rank without compute rows)."""
    if len(rank) and rank.max() >= ranks:
        keep = rank < ranks
        rank, start, end = rank[keep], start[keep], end[keep]
    first = np.full(ranks, np.inf)
    last = np.full(ranks, -np.inf)
    np.minimum.at(first, rank, start)
    np.maximum.at(last, rank, end)
    return np.where(np.isfinite(first), last - first, 0.0).tolist()


def busy_per_rank(trace: "pd.DataFrame", ranks: int) -> list[float]:
    return busy_of(*compute_spans(trace), ranks)


def span_per_rank(trace: "pd.DataFrame", ranks: int) -> list[float]:
    return span_of(*compute_spans(trace), ranks)


def slowest_of(busy: list[float], span: list[float]) -> int:
    """The rank with the largest idle share of its own span (lowest rank on ties)."""
    # np.argmax's answer over the shares (the first NaN, else the first largest), in one loop
    slowest, most = 0, None
    for r, (b, s) in enumerate(zip(busy, span)):
        share = (s - b) / s if s > 0 else 0.0
        if share != share:
            return r
        if most is None or share > most:
            slowest, most = r, share
    return slowest


def bubble_fraction(trace: "pd.DataFrame", ranks: int) -> float:
    ideal = max(busy_per_rank(trace, ranks))
    if ideal <= 0:
        raise ValueError("bubble_fraction: the trace has no compute time")
    return (makespan(trace) - ideal) / ideal


def slowest_rank(trace: "pd.DataFrame", ranks: int) -> int:
    """The rank with the largest idle share of its own span (lowest rank on ties)."""
    return slowest_of(busy_per_rank(trace, ranks), span_per_rank(trace, ranks))


def bubble_rate(trace: "pd.DataFrame", ranks: int) -> float:
    r = slowest_rank(trace, ranks)
    busy, span = busy_per_rank(trace, ranks)[r], span_per_rank(trace, ranks)[r]
    return 1.0 - busy / span if span > 0 else 0.0


def bubble_per_rank(trace: "pd.DataFrame", ranks: int) -> list[float]:
    return [s - b for b, s in zip(busy_per_rank(trace, ranks), span_per_rank(trace, ranks))]


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Measure of the union of intervals ``[starts[i], ends[i]]``, vectorised.

    Sorted by start, interval i adds ``max(0, end_i - max(start_i, M))`` where ``M`` is the
    largest end among the intervals before it.
    """
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts, float)[order], np.asarray(ends, float)[order]
    prev = np.maximum.accumulate(e)
    prev = np.concatenate(([-np.inf], prev[:-1]))
    return float(np.clip(e - np.maximum(s, prev), 0.0, None).sum())


def comm_wait_per_rank(trace: "pd.DataFrame", ranks: int) -> list[float]:
    out = [0.0] * ranks
    for r, rows in trace.groupby("rank"):
        comp = rows[rows["kind"] == "compute"]
        both = union_length(rows["start"].to_numpy(), rows["end"].to_numpy())
        out[int(r)] = both - union_length(comp["start"].to_numpy(), comp["end"].to_numpy())
    return out


def inflight_timeline(trace: "pd.DataFrame") -> "pd.DataFrame":
    """Microbatches in flight per rank over time, from compute rows alone.

    A ``(stage, microbatch)`` pair is in flight from the start of its F until the end of its
    B or I, the backward that frees the bulk of its activations (what W still needs after I is
    counted in bytes by the memory model, not here: the Zero Bubble paper counts in-flight
    microbatches the same way). Pairs of every chunk of the rank are counted (so an interleaved
    rank with 2 chunks can hold 2 pairs of one microbatch). In a trace without any backward
    (forward-only), a pair is in flight only during its F.
    Returns columns rank, time, inflight (after the event); frees sort before allocations at the
    same instant, as they happen one after the other on one rank.
    """
    import pandas as pd

    rows = _compute_rows(trace)
    ops = rows["op"].to_numpy()
    start, end, rank = rows["start"].to_numpy(float), rows["end"].to_numpy(float), rows["rank"].to_numpy()
    has_backward = bool(np.isin(ops, ("B", "I")).any())
    is_f = ops == "F"
    frees = np.isin(ops, ("B", "I")) if has_backward else is_f
    times = np.concatenate((start[is_f], end[frees]))
    deltas = np.concatenate((np.ones(is_f.sum()), -np.ones(frees.sum())))
    prio = np.concatenate((np.ones(is_f.sum()), np.zeros(frees.sum())))
    ranks = np.concatenate((rank[is_f], rank[frees]))
    order = np.lexsort((prio, times, ranks))
    frame = pd.DataFrame({"rank": ranks[order], "time": times[order], "inflight": deltas[order]})
    frame["inflight"] = frame.groupby("rank")["inflight"].cumsum().astype(int)
    return frame.reset_index(drop=True)


def peak_inflight_per_rank(trace: "pd.DataFrame", ranks: int) -> list[int]:
    frame = inflight_timeline(trace)
    peaks = frame.groupby("rank")["inflight"].max()
    return [int(peaks.get(r, 0)) for r in range(ranks)]
