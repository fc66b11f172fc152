"""The trace: one row per span, the format shared by simulated and measured runs.

Columns (``TRACE_COLUMNS``):

========== ==========================================================================
rank       pipeline rank that ran the span
op         F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B (or ALLREDUCE / OPTIMIZER in a step tail)
stage      global stage (-1 for step-tail rows)
chunk      the stage's index among its rank's stages (-1 for step-tail rows)
microbatch microbatch (-1 for step-tail rows)
start, end seconds, on one clock for all ranks
kind       "compute" (F/B/I/W/OPTIMIZER) or "comm"
bytes      bytes moved (comm rows; 0 for compute)
peer       the other rank of a comm row (-1 for compute)
========== ==========================================================================

A SEND row spans the transfer on the link (from when the link takes it to when it arrives);
a RECV row spans the time the receiving rank waited for it (zero when the data was already
there). ``bytes`` and ``peer`` are optional for metrics; every metric in :mod:`pipesim.sim.metrics`
needs only the first eight columns.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

TRACE_COLUMNS = ("rank", "op", "stage", "chunk", "microbatch", "start", "end", "kind", "bytes", "peer")
REQUIRED_COLUMNS = TRACE_COLUMNS[:8]
KINDS = ("compute", "comm")
COMPUTE_KIND, COMM_KIND = KINDS


def check_trace(trace: "pd.DataFrame") -> "pd.DataFrame":
    """Raise ValueError naming what is wrong with ``trace``; return it unchanged when fine."""
    missing = [c for c in REQUIRED_COLUMNS if c not in trace.columns]
    if missing:
        raise ValueError(f"trace is missing column(s) {', '.join(missing)}; a trace has columns "
                         f"{', '.join(TRACE_COLUMNS)}")
    if len(trace) == 0:
        raise ValueError("trace has no rows")
    kind = trace["kind"]
    # a categorical column whose categories are all known cannot hold another value
    categories = getattr(getattr(kind, "cat", None), "categories", None) \
        if str(kind.dtype) == "category" else None
    if categories is None or not set(categories) <= set(KINDS):
        bad = set(kind.unique()) - set(KINDS)
        if bad:
            raise ValueError(f"trace column 'kind' has value(s) {sorted(bad)}, expected "
                             f"{list(KINDS)}")
    backwards = trace["end"].to_numpy() < trace["start"].to_numpy()
    if backwards.any():
        row = trace[backwards].iloc[0]
        raise ValueError(f"trace row for rank {row['rank']} action {row['stage']}{row['op']}"
                         f"{row['microbatch']} ends ({row['end']}) before it starts ({row['start']})")
    if (trace["rank"].to_numpy() < 0).any():
        raise ValueError("trace column 'rank' has negative values")
    return trace


def num_ranks(trace: "pd.DataFrame") -> int:
    return int(trace["rank"].max()) + 1
