"""`Spans`: a simulated step as the engine leaves it, before it is a trace DataFrame.

Building the DataFrame (and the columns that do not depend on timing) costs about as much as
simulating a small schedule, and most callers (the planner, sweeps) read only metrics. So the
engine hands :class:`pipesim.SimResult` this value: the start and end of every row, which rows
are computations and on which rank, and a way to make the trace when somebody asks for it.
The trace made from it has the columns, dtypes and values of :mod:`pipesim.sim.trace`; metrics
read from the arrays equal those read from that trace (``tests/test_sim_fast_paths.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import numpy as np

from . import metrics
from .memory import ComputeRows
from ..schedule.op import FIRST_SHARD_CODE, TRACE_OPS, Op
from .trace import TRACE_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

    from .rows import RowArrays


# Up to this many rows the time metrics are summed in Python from the engine's lists (see
# Spans); above, numpy on arrays is faster.
SMALL_ROWS = 512


class Spans:
    """Rows in (rank, action) order: ``starts``/``ends`` (float arrays; a small run's lists
    made arrays on first read), ``row_rank`` (each row's rank), ``compute_rows`` (the
    compute rows' indices, ascending) with their ``compute_rank``, and ``columns``, a function
    returning the other trace columns (``engine._columns``' dict), called at most once.
    ``program_rows``, when the rows are the program's alone (no step-tail rows): its
    :class:`pipesim.sim.rows.RowArrays`, from which the memory model reads the computations'
    ops without the columns, and each rank's span is its last computation's end less its first
    one's start.

    The time metrics of a small schedule (up to `SMALL_ROWS` rows, given as lists) are summed
    from the lists in Python when it is made, as ``times`` (makespan, busy, span; None for any
    other run): numpy's cost per call (a microsecond or so, a dozen calls) would be most of the
    run. They are the same floats: the same additions in the same order as ``np.bincount``, and
    the same maxima and minima."""

    __slots__ = ("_starts", "_ends", "_lists", "_small", "row_rank", "compute_rows",
                 "compute_rank", "_columns", "_made", "_program_rows", "times")

    def __init__(self, starts: "Sequence[float]", ends: "Sequence[float]", row_rank: np.ndarray,
                 compute_rows: np.ndarray, compute_rank: np.ndarray,
                 columns: Callable[[], dict], program_rows: "RowArrays | None" = None) -> None:
        # the time metrics from the lists: given them, the program's rows, and few rows; a
        # larger run's lists become arrays now (a float object a row, kept, would weigh three
        # times the array on every result held)
        self._small = (type(starts) is list and type(ends) is list
                       and program_rows is not None and len(starts) <= SMALL_ROWS)
        self.row_rank = row_rank
        self.compute_rows, self.compute_rank = compute_rows, compute_rank
        self._columns, self._made = columns, None
        self._program_rows = program_rows
        self.times: tuple[float, list[float], list[float]] | None = None
        if not self._small:
            self._starts = np.asarray(starts, dtype=float)
            self._ends = np.asarray(ends, dtype=float)
            self._lists = None
            return
        self._starts = self._ends = None
        self._lists = (starts, ends)
        # ``times`` now, in one pass over the computations: every small run's result takes
        # them when it is made (`SimResult.from_spans`), and here they cost no call of their own
        busy, span = [], []
        for computations in program_rows.by_rank:
            total = 0.0
            for i in computations:
                total += ends[i] - starts[i]
            busy.append(total)
            span.append(ends[computations[-1]] - starts[computations[0]] if computations else 0.0)
        self.times = max(ends) - min(starts), busy, span

    @property
    def starts(self) -> np.ndarray:
        if self._starts is None:
            self._starts = np.asarray(self._lists[0], dtype=float)
        return self._starts

    @property
    def ends(self) -> np.ndarray:
        if self._ends is None:
            self._ends = np.asarray(self._lists[1], dtype=float)
        return self._ends

    def __reduce__(self):
        """Pickled with its columns made (a closure does not pickle), e.g. to cross processes."""
        return (Spans, (self.starts, self.ends, self.row_rank, self.compute_rows,
                        self.compute_rank, partial(dict, self.columns()), self._program_rows))

    def columns(self) -> dict:
        if self._made is None:
            self._made = self._columns()
        return self._made

    def compute_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rank, start, end) of the compute rows, as :func:`pipesim.sim.metrics.compute_spans`."""
        return self.compute_rank, self.starts[self.compute_rows], self.ends[self.compute_rows]

    def busy(self, pp: int) -> list[float]:
        """:func:`pipesim.sim.metrics.busy_of` of the compute rows."""
        if self._small and len(self._program_rows.by_rank) == pp:
            return self.small_times(pp)[1]
        return metrics.busy_of(*self.compute_spans(), pp)

    def span(self, pp: int) -> list[float]:
        """:func:`pipesim.sim.metrics.span_of` of the compute rows: with the program's rows, from
        each rank's first and last computation (the same floats: those are its least start and
        its greatest end)."""
        rows = self._program_rows
        if rows is None or len(rows.by_rank) != pp:
            return metrics.span_of(*self.compute_spans(), pp)
        if self._small:
            return self.small_times(pp)[2]
        span = self.ends[rows.last_compute] - self.starts[rows.first_compute]
        if rows.idle_ranks.size:
            span[rows.idle_ranks] = 0.0
        return span.tolist()

    def small_times(self, pp: int) -> tuple[float, list[float], list[float]] | None:
        """`times` where they are over ``pp`` ranks; None for any other run."""
        times = self.times
        if times is None or len(times[1]) != pp:
            return None
        return times

    def memory_rows(self) -> ComputeRows:
        """The compute rows of real stages, as :func:`pipesim.sim.memory.compute_rows` reads them
        from a trace."""
        rows = self._program_rows
        if rows is not None:
            cr = self.compute_rows
            return ComputeRows(rows.compute_rank, rows.compute_code, rows.compute_stage,
                               rows.compute_microbatch, self.starts[cr], self.ends[cr])
        columns = self.columns()
        rows = self.compute_rows[columns["stage"][self.compute_rows] >= 0]
        return ComputeRows(columns["rank"][rows], columns["op"][rows],
                           columns["stage"][rows], columns["microbatch"][rows],
                           self.starts[rows], self.ends[rows])

    def makespan(self) -> float:
        if self._small:
            starts, ends = self._lists
            return max(ends) - min(starts)
        return float(np.maximum.reduce(self.ends) - np.minimum.reduce(self.starts))

    def rank_end(self, pp: int) -> list[float]:
        """Last end of each rank's rows (0 for a rank without rows)."""
        last = np.full(pp, -np.inf)
        np.maximum.at(last, self.row_rank, self.ends)
        return np.where(np.isfinite(last), last, 0.0).tolist()

    def frame(self) -> "pd.DataFrame":
        """The trace DataFrame over these arrays (no copies: nothing else writes them)."""
        import pandas as pd

        op_dtype, kind_dtype = _dtypes()
        data = dict(self.columns())
        codes = data["op"]
        if codes.size and codes.max() >= FIRST_SHARD_CODE:
            # ZeRO's sharding rows: their categories after the others' (no overlap row between)
            op_dtype = _sharded_dtype()
            codes = np.where(codes >= FIRST_SHARD_CODE, codes - 1, codes)
        data["op"] = pd.Categorical.from_codes(codes, dtype=op_dtype)
        data["kind"] = pd.Categorical.from_codes(data["kind"], dtype=kind_dtype)
        data["start"], data["end"] = self.starts, self.ends
        return pd.DataFrame({name: data[name] for name in TRACE_COLUMNS}, copy=False)


@lru_cache(maxsize=1)
def _dtypes():
    """The trace's two categorical dtypes (immutable; built once: pandas' per-call inference of
    the categories was a third of the trace's cost on small schedules)."""
    import pandas as pd

    return (pd.CategoricalDtype([op.value for op in TRACE_OPS]),
            pd.CategoricalDtype(["compute", "comm"]))


@lru_cache(maxsize=1)
def _sharded_dtype():
    """The ``op`` dtype of a trace with sharding rows: `TRACE_OPS`, then the sharding ops."""
    import pandas as pd

    return pd.CategoricalDtype([op.value for op in TRACE_OPS]
                               + [op.value for op in Op if op.is_shard])
