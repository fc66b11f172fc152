"""`Spans`: a simulated step as the engine leaves it, before it is a trace DataFrame.

Building the DataFrame (and the columns that do not depend on timing) costs about as much as
simulating a small schedule, and most callers (the planner, sweeps) read only metrics. So the
engine hands :class:`pipesim.SimResult` this value: the start and end of every row, which rows
are computations and on which rank, and a way to make the trace when somebody asks for it.
The trace made from it has the columns, dtypes and values of :mod:`pipesim.trace`; metrics
read from the arrays equal those read from that trace (``tests/test_sim_fast_paths.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from .schedule.action import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W
from .trace import TRACE_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

# Op codes of the trace's categorical ``op`` column (step-tail ops last).
OPS = (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B)
TAIL_OPS = ("ALLREDUCE", "OPTIMIZER")


class Spans:
    """Rows in (rank, action) order: ``starts``/``ends`` (float arrays), ``compute_rows`` (the
    compute rows' indices, ascending) with their ``compute_rank``, and ``columns``, a function
    returning the other trace columns (``engine._columns``' dict), called at most once."""

    __slots__ = ("starts", "ends", "compute_rows", "compute_rank", "_columns", "_made")

    def __init__(self, starts: np.ndarray, ends: np.ndarray, compute_rows: np.ndarray,
                 compute_rank: np.ndarray, columns: Callable[[], dict]) -> None:
        self.starts, self.ends = starts, ends
        self.compute_rows, self.compute_rank = compute_rows, compute_rank
        self._columns, self._made = columns, None

    def columns(self) -> dict:
        if self._made is None:
            self._made = self._columns()
        return self._made

    def compute_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rank, start, end) of the compute rows, as :func:`pipesim.metrics.compute_spans`."""
        return self.compute_rank, self.starts[self.compute_rows], self.ends[self.compute_rows]

    def makespan(self) -> float:
        return float(self.ends.max() - self.starts.min())

    def frame(self) -> "pd.DataFrame":
        """The trace DataFrame over these arrays (no copies: nothing else writes them)."""
        import pandas as pd

        op_dtype, kind_dtype = _dtypes()
        data = dict(self.columns())
        data["op"] = pd.Categorical.from_codes(data["op"], dtype=op_dtype)
        data["kind"] = pd.Categorical.from_codes(data["kind"], dtype=kind_dtype)
        data["start"], data["end"] = self.starts, self.ends
        return pd.DataFrame({name: data[name] for name in TRACE_COLUMNS}, copy=False)


@lru_cache(maxsize=1)
def _dtypes():
    """The trace's two categorical dtypes (immutable; built once: pandas' per-call inference of
    the categories was a third of the trace's cost on small schedules)."""
    import pandas as pd

    return (pd.CategoricalDtype(list(OPS + TAIL_OPS)), pd.CategoricalDtype(["compute", "comm"]))
