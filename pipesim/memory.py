"""The activation-memory model, replayed over a trace's compute rows.

Per rank, bytes held = static bytes + activations of the (stage, microbatch) pairs in flight:

* F adds the stage's ``activation_bytes`` when it starts (it fills them while it runs);
* B frees them all when it ends;
* I frees all but the ``weight_grad_fraction`` share that W needs, when it ends;
* W frees that share when it ends.
* In a trace with no backward at all (forward-only), F's activations are freed at its end.

Frees sort before allocations at the same instant. Static bytes per rank are
``CostModel.static_bytes[rank]`` plus ``stage_static_bytes`` of every stage the rank holds.
Because it reads only the trace, the same model predicts a measured run's memory from its
measured timing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

    from .costs import CostModel


def memory_timeline(trace: "pd.DataFrame", costs: "CostModel", num_stages: int, pp: int,
                    rank_stages: Sequence[Sequence[int]] | None = None) -> "pd.DataFrame":
    """Columns rank, time, bytes: bytes held on the rank after each event.

    Each rank's timeline starts with its static bytes at the trace's first start.
    """
    import pandas as pd

    act = np.asarray(costs.stage_values("activation_bytes", num_stages), float)
    wshare = np.asarray(costs.stage_values("weight_grad_fraction", num_stages), float)
    static_stage = costs.stage_values("stage_static_bytes", num_stages)
    static_rank = costs.rank_static_bytes(pp)
    rows = trace[trace["kind"] == "compute"]
    rows = rows[rows["stage"] >= 0]
    ops = rows["op"].to_numpy()
    stage = rows["stage"].to_numpy(int)
    if len(stage) and stage.max() >= num_stages:
        raise ValueError(f"trace names stage {stage.max()}, outside 0..{num_stages - 1}")
    start, end, rank = rows["start"].to_numpy(float), rows["end"].to_numpy(float), rows["rank"].to_numpy(int)
    has_backward = bool(np.isin(ops, ("B", "I", "W")).any())
    parts = []  # (mask, time, delta, prio)
    is_f = ops == "F"
    parts.append((is_f, start, act[stage], 1))
    if has_backward:
        parts.append((ops == "B", end, -act[stage], 0))
        parts.append((ops == "I", end, -(1 - wshare[stage]) * act[stage], 0))
        parts.append((ops == "W", end, -wshare[stage] * act[stage], 0))
    else:
        parts.append((is_f, end, -act[stage], 0))
    times = np.concatenate([t[m] for m, t, _, _ in parts])
    deltas = np.concatenate([d[m] for m, _, d, _ in parts])
    prio = np.concatenate([np.full(m.sum(), p) for m, _, _, p in parts])
    ranks = np.concatenate([rank[m] for m, _, _, _ in parts])

    if rank_stages is None:
        held = rows.groupby("rank")["stage"].unique()
        rank_stages = [list(held.get(r, [])) for r in range(pp)]
    static = np.array([static_rank[r] + sum(static_stage[s] for s in rank_stages[r]) for r in range(pp)])
    t0 = float(trace["start"].min())
    times = np.concatenate((np.full(pp, t0), times))
    deltas = np.concatenate((static, deltas))
    prio = np.concatenate((np.full(pp, -1), prio))
    ranks = np.concatenate((np.arange(pp), ranks))
    order = np.lexsort((prio, times, ranks))
    frame = pd.DataFrame({"rank": ranks[order], "time": times[order], "bytes": deltas[order]})
    frame["bytes"] = frame.groupby("rank")["bytes"].cumsum()
    return frame.reset_index(drop=True)


def peak_per_rank(timeline: "pd.DataFrame", pp: int) -> list[float]:
    """Largest ``bytes`` of each rank in a timeline with columns rank, time, bytes."""
    peaks = timeline.groupby("rank")["bytes"].max()
    return [float(peaks.get(r, 0.0)) for r in range(pp)]
