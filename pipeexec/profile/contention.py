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
* `shares_cores` says whether a run's ranks competed for cores at all: what they could keep
  busy (``rank_cpus``: threads, capped by affinity and CPU quota, :mod:`pipeexec.cpu_quota`)
  against the machine's CPUs. Ranks confined to a share each (``--cpus-per-rank``), or fewer
  than the cores, run at their own speed whatever the others do, and wall-time costs then
  carry over as they are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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


def shares_cores(meta: dict) -> bool:
    """Whether the ranks of a run with this metadata competed for the machine's cores.

    They did when together they could keep all of its CPUs busy (the runtime's communication
    threads and the OS then take their time from the ranks too), unless every rank was confined
    to a share below one CPU that together fit the machine (``--cpus-per-rank``): each then runs
    at its own speed. True for runs recorded without ``rank_cpus``, the conservative answer.
    """
    cpus, host = meta.get("rank_cpus"), meta.get("host_cpus")
    if not cpus or not host:
        return True
    total = float(sum(cpus))
    confined = all(c < 1.0 for c in cpus) and total <= host + 1e-6
    return not confined and total >= host - 1e-6


def time_sharing_note(meta: dict) -> str | None:
    """A warning for a CPU run whose ranks wanted more CPUs than the machine has (and were not
    confined): what each action took then depended on which ranks computed at the same moment,
    which per-stage costs cannot carry, so how the idle time falls on each rank (bubble_fraction)
    is predicted less well than the step time. None otherwise."""
    cpus, host = meta.get("rank_cpus"), meta.get("host_cpus")
    if not cpus or not host or not str(meta.get("device", "cpu")).startswith("cpu"):
        return None
    ranks = len(cpus) * int(meta.get("dp", 1))
    wanted = float(sum(cpus)) * int(meta.get("dp", 1))
    if wanted <= host + 1e-6 or not shares_cores(meta):
        return None
    return (f"{ranks} ranks wanting {wanted:g} CPUs time-shared {host} CPUs: an action's time "
            "depended on which ranks computed with it, so per-rank idle time (bubble_fraction) "
            "is predicted less well than the step time; to give each rank its own share, run "
            f"with --cpus-per-rank {host / ranks:g}")


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

