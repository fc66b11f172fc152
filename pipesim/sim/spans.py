"""`Spans`: a simulated step as the engine leaves it, before it is a trace DataFrame.

Building the DataFrame (and the columns that do not depend on timing) costs about as much as
simulating a small schedule, and most callers (the planner, sweeps) read only metrics. So the
engine hands :class:`pipesim.SimResult` this value: the start and end of every row, which rows
are computations and on which rank, and a way to make the trace when somebody asks for it.
The trace made from it has the columns, dtypes and values of :mod:`pipesim.sim.trace`; metrics
read from the arrays equal those read from that trace (``tests/test_sim_fast_paths.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import numpy as np

from .memory import ComputeRows
from ..schedule.op import FIRST_SHARD_CODE, TRACE_OPS, Op
from .trace import TRACE_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

# The trace's categorical ``op`` column: a row's code is its Op's ``code`` (step-tail ops last).
_OP_NAMES = np.asarray([op.value for op in TRACE_OPS], dtype=object)


class Spans:
    """Rows in (rank, action) order: ``starts``/``ends`` (float arrays), ``row_rank`` (each
    row's rank), ``compute_rows`` (the
    compute rows' indices, ascending) with their ``compute_rank``, and ``columns``, a function
    returning the other trace columns (``engine._columns``' dict), called at most once.
    ``compute_ops``, when given (no step-tail rows): a function returning (op names, stage,
    microbatch) of the compute rows alone, which is all the memory model needs of the columns."""

    __slots__ = ("starts", "ends", "row_rank", "compute_rows", "compute_rank", "_columns", "_made",
                 "_compute_ops")

    def __init__(self, starts: np.ndarray, ends: np.ndarray, row_rank: np.ndarray,
                 compute_rows: np.ndarray, compute_rank: np.ndarray,
                 columns: Callable[[], dict],
                 compute_ops: Callable[[], tuple] | None = None) -> None:
        self.starts, self.ends, self.row_rank = starts, ends, row_rank
        self.compute_rows, self.compute_rank = compute_rows, compute_rank
        self._columns, self._made = columns, None
        self._compute_ops = compute_ops

    def __reduce__(self):
        """Pickled with its columns made (a closure does not pickle), e.g. to cross processes."""
        return (Spans, (self.starts, self.ends, self.row_rank, self.compute_rows,
                        self.compute_rank, partial(dict, self.columns())))

    def columns(self) -> dict:
        if self._made is None:
            self._made = self._columns()
        return self._made

    def compute_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rank, start, end) of the compute rows, as :func:`pipesim.sim.metrics.compute_spans`."""
        return self.compute_rank, self.starts[self.compute_rows], self.ends[self.compute_rows]

    def memory_rows(self) -> ComputeRows:
        """The compute rows of real stages, as :func:`pipesim.sim.memory.compute_rows` reads them
        from a trace."""
        if self._compute_ops is not None and self._made is None:
            op, stage, mb = self._compute_ops()
            return ComputeRows(self.compute_rank, op, stage, mb, self.starts[self.compute_rows],
                               self.ends[self.compute_rows])
        columns = self.columns()
        rows = self.compute_rows[columns["stage"][self.compute_rows] >= 0]
        return ComputeRows(columns["rank"][rows], _OP_NAMES[columns["op"][rows]],
                           columns["stage"][rows], columns["microbatch"][rows],
                           self.starts[rows], self.ends[rows])

    def rank_end(self, pp: int) -> list[float]:
        """Last end of each rank's rows (0 for a rank without rows)."""
        last = np.full(pp, -np.inf)
        np.maximum.at(last, self.row_rank, self.ends)
        return np.where(np.isfinite(last), last, 0.0).tolist()

    def makespan(self) -> float:
        return float(self.ends.max() - self.starts.min())

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
