"""More ranks than cores: a processor-sharing correction around the pipesim simulator.

On a machine with C cores running p > C ranks (the CPU benchmarks: 4 ranks on 2 cores), an
action's wall time is its CPU work stretched by how many ranks compute at the same moment:
processor sharing gives each of n computing ranks min(1, C/n) of a core. The schedule decides
that overlap, so wall-time costs measured under one schedule do not carry over to another
(1F1B's steady state keeps every rank busy; interleaving and zero-bubble schedules change who
overlaps whom). CPU work (``time.thread_time`` per computation, the ``cpu`` column of a
measured trace) does carry over.

* `effective_cores` finds the C that makes processor sharing explain a measured run: the CPU
  work of all its computations equals their progress at rate min(1, C/n(t)) over their wall
  spans. Other processes on the machine lower it below the core count.
* `contention_costs` predicts wall-time costs for another schedule from CPU-work costs: a
  fixed point of "simulate, measure each (op, stage)'s mean slowdown in the simulated trace,
  stretch the work by it", damped, with the unmodified pipesim engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import pipesim

if TYPE_CHECKING:
    import pandas as pd

    from pipesim import CostModel, SimResult

_FIELDS = (("F", "forward"), ("B", "backward"), ("I", "backward_input"), ("W", "backward_weight"))


def progress(trace: "pd.DataFrame", cores: float) -> np.ndarray:
    """For each compute row (in the order of ``trace[kind == compute]``), the CPU work it gets
    done over its wall span under processor sharing of ``cores`` among computing ranks."""
    rows = trace[trace["kind"] == "compute"]
    s, e = rows["start"].to_numpy(float), rows["end"].to_numpy(float)
    if len(s) == 0:
        return np.zeros(0)
    times = np.concatenate((s, e))
    delta = np.concatenate((np.ones(len(s)), -np.ones(len(e))))
    order = np.lexsort((delta, times))            # ends before starts at one instant
    t, d = times[order], delta[order]
    n = np.cumsum(d)                              # computing ranks after each event
    rate = np.where(n > 0, np.minimum(1.0, cores / np.maximum(n, 1.0)), 1.0)
    length = np.diff(t, append=t[-1])
    work = np.concatenate(([0.0], np.cumsum(rate * length)))[:-1]   # work rate integral at t
    # R(x) at each row's start and end: the integral up to the first event at x.
    r_start = work[np.searchsorted(t, s, side="left")]
    r_end = work[np.searchsorted(t, e, side="left")]
    return r_end - r_start


def effective_cores(trace: "pd.DataFrame", cpu: np.ndarray | None = None) -> float:
    """C such that processor sharing of C cores explains the trace's CPU work (``cpu`` column,
    or ``cpu`` given per compute row). Bounded by [0.05, number of ranks]."""
    rows = trace[trace["kind"] == "compute"]
    work = rows["cpu"].to_numpy(float) if cpu is None else np.asarray(cpu, float)
    ok = np.isfinite(work)
    if not ok.any():
        raise ValueError("effective_cores: the trace has no CPU times (a GPU run, or an old "
                         "trace without the cpu column)")
    total = float(work[ok].sum())
    ranks = float(trace["rank"].nunique())
    lo, hi = 0.05, ranks
    if float(progress(trace, hi)[ok].sum()) <= total:
        return hi                                  # no sign of sharing
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if float(progress(trace, mid)[ok].sum()) < total:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def slowdowns(trace: "pd.DataFrame", cores: float, num_stages: int) -> dict[str, list[float]]:
    """Mean wall / work per (op, stage) in a simulated trace under processor sharing."""
    rows = trace[trace["kind"] == "compute"]
    wall = (rows["end"] - rows["start"]).to_numpy(float)
    got = progress(trace, cores)
    ratio = np.where(got > 0, wall / np.maximum(got, 1e-300), 1.0)
    frame = rows[["op", "stage"]].assign(ratio=ratio)
    frame["op"] = frame["op"].astype(str)
    means = frame.groupby(["op", "stage"])["ratio"].mean()
    out = {}
    for op, _ in _FIELDS:
        out[op] = [float(means.get((op, s), 1.0)) for s in range(num_stages)]
    return out


@dataclass
class ContentionPrediction:
    costs: "CostModel"           # wall-time costs for the target schedule
    result: "SimResult"
    cores: float
    iterations: int
    slowdown: dict[str, list[float]]


def contention_costs(schedule: "pipesim.Schedule", work: "CostModel", cores: float, *,
                     iterations: int = 30, damping: float = 0.5, tol: float = 1e-4,
                     comm: str = "async") -> ContentionPrediction:
    """Wall-time costs of ``schedule`` on ``cores`` cores from CPU-work costs ``work``
    (simulated with ``pipesim.simulate``'s ``comm`` mode)."""
    n = schedule.num_stages
    base = work.compute_times(n)       # F, B, I, W with the model's defaults applied
    factor = {op: [1.0] * n for op, _ in _FIELDS}
    it = 0
    for it in range(1, iterations + 1):
        result = pipesim.simulate(schedule, _scaled(work, base, factor), comm=comm)
        # wall / progress in the simulated trace is the factor that would make each
        # computation's progress equal its work: the fixed point is factor == that ratio.
        slow = slowdowns(result.trace, cores, n)
        change = 0.0
        for op in factor:
            for s in range(n):
                target = (1 - damping) * factor[op][s] + damping * slow[op][s]
                change = max(change, abs(target - factor[op][s]) / factor[op][s])
                factor[op][s] = target
        if change < tol:
            break
    costs = _scaled(work, base, factor)
    return ContentionPrediction(costs, pipesim.simulate(schedule, costs, comm=comm), cores, it,
                                factor)


def _scaled(work: "CostModel", base: dict, factor: dict) -> "CostModel":
    return work.with_(**{field: [b * f for b, f in zip(base[op], factor[op])]
                         for op, field in _FIELDS})
