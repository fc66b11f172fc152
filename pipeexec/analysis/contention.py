"""More ranks than cores: how many cores a CPU run effectively had.

On a machine with C cores running p > C ranks (the CPU benchmarks: 4 ranks on 2 cores), an
action's wall time is its CPU work stretched by how many ranks compute at the same moment:
processor sharing gives each of n computing ranks min(1, C/n) of a core. The schedule decides
that overlap, so wall-time costs measured under one schedule do not carry over to another
(1F1B's steady state keeps every rank busy; interleaving and zero-bubble schedules change who
overlaps whom). CPU work (``time.thread_time`` per computation, the ``cpu`` column of a
measured trace) does carry over: `pipesim.simulate(costs=work, cores=C)` shares C cores among
the ranks computing at each moment of the target schedule.

* `progress`: the work each computation of a trace gets done over its wall span when C cores
  are shared among the computing ranks.
* `effective_cores` finds the C that makes processor sharing explain a measured run: the CPU
  work of all its computations equals their progress over their wall spans. Other processes
  on the machine lower it below the core count.
* `shares_cores` says whether a run's ranks competed for cores at all: on each host, what its
  ranks could keep busy (``rank_cpus``: threads, capped by affinity and CPU quota,
  :mod:`pipeexec.launching.cpu_quota`) against that host's CPUs (the profile's ``hosts``). Ranks confined to a share each (``--cpus-per-rank``), or fewer
  than the cores, run at their own speed whatever the others do, and wall-time costs then
  carry over as they are.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from .run_plan import RunPlan

if TYPE_CHECKING:
    import pandas as pd


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


def _hosts(plan: RunPlan) -> list[Mapping[str, float]] | None:
    """Per host: ``cpus``, ``ranks``, ``rank_cpus`` (what its ranks could keep busy together)
    and ``max_rank_cpus``. Runs recorded before ``hosts`` was: every rank on rank 0's host.
    None when not recorded at all."""
    if plan.hosts:
        return list(plan.hosts.values())
    cpus, host, dp = plan.rank_cpus, plan.host_cpus, plan.dp
    if not cpus or not host:
        return None
    return [{"cpus": host, "ranks": len(cpus) * dp, "rank_cpus": float(sum(cpus)) * dp,
             "max_rank_cpus": max(cpus)}]


def _competing(h: Mapping[str, float]) -> bool:
    """Whether the ranks on host ``h`` competed for its cores: together they could keep all of
    its CPUs busy (the runtime's communication threads and the OS then take their time from the
    ranks too), unless every rank was confined to a share below one CPU and the shares fit."""
    confined = h["max_rank_cpus"] < 1.0 and h["rank_cpus"] <= h["cpus"] + 1e-6
    return not confined and h["rank_cpus"] >= h["cpus"] - 1e-6


def shares_cores(plan: RunPlan) -> bool:
    """Whether the ranks of a run of ``plan`` competed for cores on any of its hosts
    (each rank's CPUs: threads capped by affinity and quota, ``--cpus-per-rank``). Ranks
    confined to a share each, or fewer than a host's cores, run at their own speed. True for
    runs recorded without CPU counts, the conservative answer."""
    hosts = _hosts(plan)
    return hosts is None or any(_competing(h) for h in hosts)


def time_sharing_note(plan: RunPlan) -> str | None:
    """A warning for a CPU run whose ranks wanted more CPUs than their host has (and were not
    confined): what each action took then depended on which ranks computed at the same moment,
    which per-stage costs cannot carry, so how the idle time falls on each rank (bubble_fraction)
    is predicted less well than the step time. None otherwise."""
    hosts = _hosts(plan)
    if hosts is None or not plan.device.startswith("cpu"):
        return None
    for h in hosts:
        if h["rank_cpus"] > h["cpus"] + 1e-6 and _competing(h):
            where = f"{h['cpus']:g} CPUs" + (" of one host" if len(hosts) > 1 else "")
            return (f"{h['ranks']:g} ranks wanting {h['rank_cpus']:g} CPUs time-shared {where}: "
                    "an action's time depended on which ranks computed with it, so per-rank "
                    "idle time (bubble_fraction) is predicted less well than the step time; to "
                    f"give each rank its own share, run with --cpus-per-rank "
                    f"{h['cpus'] / h['ranks']:g}")
    return None


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
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(progress(trace, mid)[ok].sum()) < total:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)

