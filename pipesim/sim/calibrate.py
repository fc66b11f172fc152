"""Fit a :class:`CostModel` to a trace: per-stage means of F, B, I, W, a p2p line, and ZeRO's
UNSHARD / REDUCE_GRAD per stage.

This is how a measured run (the executor's trace) becomes a model that predicts other
schedules: the compute time of an action depends on its stage, not on the schedule around it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..plan.costs import CostModel
from .trace import check_trace

if TYPE_CHECKING:
    import pandas as pd

_SENDS = ("SEND_F", "SEND_B")
# ZeRO's priced actions and their CostModel fields (a RESHARD, a release, costs nothing)
SHARDING_FIELDS = (("UNSHARD", "unshard"), ("REDUCE_GRAD", "reduce_grad"))


def fit_costs(trace: "pd.DataFrame", num_stages: int | None = None, *,
              stage_parts: "tuple[int, ...] | None" = None, **overrides: Any) -> CostModel:
    """Per-stage mean duration of each compute op, and ``p2p_latency`` / ``p2p_bandwidth``.

    * F is required on every stage. B, I and W are fitted where the trace has them: a trace
      with only I and W leaves B to default to I + W; one with only B leaves I and W to split it.
    * Communication: a least-squares line ``duration = latency + bytes / bandwidth`` through the
      SEND rows (each spans one transfer). With a single message size the two cannot be told
      apart, so latency is 0 and bandwidth = bytes / mean duration. ``p2p_bytes`` per stage is
      the mean size of the forward messages the stage sends. No SEND rows: zero-cost links.
      A measured trace with an ``arrival_observed`` column (pipeexec's) is fitted on the rows
      where it is True, timed from ``link_start`` when that column exists.
    * ``stage_parts`` (a schedule's, when stages are copies of model parts: dualpipe): the
      compute means are pooled over the stages of each part (a copy runs the same layers), so
      a copy that never runs some op (dualpipe's stages see only half the microbatches) gets
      its part's; the result is still per stage. A part with only full backwards B gets I
      and W as an even split of its B.
    * ZeRO's actions (a trace of a schedule lowered with a sharding): ``unshard`` and
      ``reduce_grad`` per stage are the mean duration of its UNSHARD and REDUCE_GRAD rows
      (pooled per part as the computations are), fitted where the trace has such rows. The
      mean, as for the computations, not the median: a measured collective also waits for the
      slowest rank of its data-parallel group, a long tail, and that wait is part of the step
      the costs must add up to (on a shared 2-core machine the median priced a ZeRO-3 step's
      gathers 30-40% short).
    * ``overrides`` set any other field (memory is not in a trace's timing: pass
      ``activation_bytes`` etc. here; how the sharding actions overlap, ``overlap_sharding``,
      is the runner's, not the trace's).

    Raises ValueError naming the stage and op when a stage lacks a needed op.
    """
    check_trace(trace)
    compute = trace[(trace["kind"] == "compute") & (trace["stage"] >= 0)]
    if num_stages is None:
        num_stages = int(compute["stage"].max()) + 1
    durations = compute["end"] - compute["start"]
    part = (lambda s: s) if stage_parts is None else stage_parts.__getitem__
    where = compute["stage"] if stage_parts is None else compute["stage"].map(part)
    means = durations.groupby([compute["op"].astype(str), where]).mean()
    fitted: dict[str, Any] = {}
    for op, field in (("F", "forward"), ("B", "backward"), ("I", "backward_input"),
                      ("W", "backward_weight")):
        have = [s for s in range(num_stages) if (op, part(s)) in means.index]
        if not have:
            if op == "F":
                raise ValueError("fit_costs: the trace has no F rows")
            continue
        if len(have) != num_stages:
            missing = sorted(set(range(num_stages)) - set(have))
            split = stage_parts is not None and op in ("I", "W") and all(
                ("B", part(s)) in means.index for s in missing)
            if not split:
                raise ValueError(f"fit_costs: {op} is measured on some stages but not on "
                                 f"stage(s) {missing}")
            # with copies a part may run only full backwards (dualpipe at pp 2: the last
            # part): its I and W are an even split of its B, the CostModel's default
            fitted[field] = [float(means[(op, part(s))]) if s in have
                             else float(means[("B", part(s))]) / 2 for s in range(num_stages)]
            continue
        fitted[field] = [float(means[(op, part(s))]) for s in range(num_stages)]
    if "backward" not in fitted and ("backward_input" in fitted) != ("backward_weight" in fitted):
        raise ValueError("fit_costs: the trace has only one of I and W and no B")
    fitted.update(_fit_p2p(trace, num_stages))
    fitted.update(_fit_sharding(trace, num_stages, stage_parts))
    fitted.update(overrides)
    return CostModel(**fitted)


def _fit_p2p(trace: "pd.DataFrame", num_stages: int) -> dict[str, Any]:
    if "bytes" not in trace.columns:
        return {}
    sends = trace[trace["op"].astype(str).isin(_SENDS)]
    if len(sends) == 0:
        return {}
    out: dict[str, Any] = {}
    timed = sends
    if "arrival_observed" in sends.columns:
        # A measured trace (pipeexec.measuring): only spans whose arrival was observed are
        # transfer times; they start when both sides had posted (link_start).
        timed = sends[sends["arrival_observed"].astype(bool)]
    start = timed["link_start"] if "link_start" in timed.columns else timed["start"]
    size = timed["bytes"].to_numpy(float)
    dur = (timed["end"] - start).to_numpy(float)
    if len(timed) == 0:
        size, dur = np.zeros(1), np.zeros(1)
    if np.unique(size).size >= 2:
        slope, intercept = np.polyfit(size, dur, 1)
        latency = max(float(intercept), 0.0)
        bandwidth = 1.0 / slope if slope > 0 else math.inf
    else:
        latency, bandwidth = 0.0, (size[0] / dur.mean() if size[0] > 0 and dur.mean() > 0 else math.inf)
        if size[0] == 0:
            latency = float(dur.mean())
    out["p2p_latency"], out["p2p_bandwidth"] = latency, bandwidth
    fwd = sends[sends["op"].astype(str) == "SEND_F"]
    per_stage = fwd.groupby("stage")["bytes"].mean()
    out["p2p_bytes"] = [float(per_stage.get(s, 0.0)) for s in range(num_stages)]
    return out


def _fit_sharding(trace: "pd.DataFrame", num_stages: int,
                  stage_parts: "tuple[int, ...] | None") -> dict[str, Any]:
    """``unshard`` / ``reduce_grad``: per stage, the mean duration of its UNSHARD /
    REDUCE_GRAD rows (per part with ``stage_parts``); {} for a field whose op the trace lacks.
    Raises ValueError naming the op and the stages when only some stages have it."""
    ops = trace["op"].astype(str)
    rows = trace[ops.isin([op for op, _ in SHARDING_FIELDS])]
    if len(rows) == 0:
        return {}
    part = (lambda s: s) if stage_parts is None else stage_parts.__getitem__
    where = rows["stage"] if stage_parts is None else rows["stage"].map(part)
    means = (rows["end"] - rows["start"]).groupby([rows["op"].astype(str), where]).mean()
    out: dict[str, Any] = {}
    for op, field in SHARDING_FIELDS:
        have = [s for s in range(num_stages) if (op, part(s)) in means.index]
        if not have:
            continue
        if len(have) != num_stages:
            missing = sorted(set(range(num_stages)) - set(have))
            raise ValueError(f"fit_costs: {op} is in the trace for some stages but not for "
                             f"stage(s) {missing} (a sharded program has it on every stage)")
        out[field] = [max(float(means[(op, part(s))]), 0.0) for s in range(num_stages)]
    return out
