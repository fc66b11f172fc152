"""The search: bound every plan, simulate the ones that can still fit and win, rank them.

1. :func:`pipesim.planner.enumerate_plans` lists the valid plans of the space;
2. each plan's costs are derived and bounded (:mod:`pipesim.planner.bounds`); a plan whose
   memory bound exceeds the limit cannot fit and is pruned (first the cheap bound, here; the
   exact-order one, which builds the schedule, only for a plan about to be simulated);
3. the rest, in order of their step-time bound, are simulated with the full discrete-event
   model (:func:`pipesim.sim.plan_report.simulate_plan`) in batches; a plan is pruned when its bound
   exceeds both the ``top``-th best step time found so far and the best of its own schedule
   (so that the top plans and every schedule's best, which :func:`explain` compares, are exact).
   Ties are broken by the plan's key, so the ranking is deterministic.

Work runs on an executor: none (in this process, the default: one process spends less CPU
than a pool over two cores, whose workers each derive and build what the other does, and a
search on a shared machine is bound by its CPU, see docs/planning.md; it batches the
simulations as a pool over every core would, so that it finds what such a pool finds), a
process pool over ``workers`` processes (`default_workers`: every core), or any
``concurrent.futures.Executor``-like object with ``map``
(``distributed.Client(address).get_executor()`` for a Dask cluster). Each batch waits at most
``timeout`` seconds.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import PlanError, ScheduleError
from ..plan.plan import Plan
from ..sim.plan_report import PlanResult, simulate_plan
from ..progress import progress_bar
from .bounds import bounds_key, plan_bounds
from .collector import full_collections_paused, pause_full_collections
from .enumerate import Enumeration, SearchSpace, enumerate_plans, plan_key
from .rows import (CANDIDATE, COLUMNS, CONFIG_COLUMNS, INVALID, PRUNED_MEMORY,  # noqa: F401
                   PRUNED_TIME, SIMULATED, Assessment, PlanConfig, PlanFigures, PlanRow)
from ..units import GiB

if TYPE_CHECKING:
    import pandas as pd


# -- worker tasks (module level: a process pool or a Dask worker imports them) -----------------
def bound_plans(plans: list[Plan], memory_limit: float, prune: bool = True
                ) -> list[Assessment]:
    """Bounds of each plan: status pruned-memory (when ``prune``) / candidate ("") / invalid,
    and the CPU seconds spent."""
    out = []
    for plan in plans:
        t0 = time.process_time()
        try:
            derived = plan.derive()
            t1 = time.process_time()
            b = plan_bounds(plan, derived, exact_order=False)
            over = prune and b.memory > memory_limit
            found = Assessment(PRUNED_MEMORY if over else CANDIDATE,
                               _overflow_text(b.memory_parts, b.memory_rank, memory_limit,
                                              "at least") if over else "",
                               step_time_bound=b.step_time, memory_bound=b.memory)
        except (PlanError, ScheduleError, ValueError) as exc:
            t1 = time.process_time()
            found = Assessment(INVALID, str(exc))
        t2 = time.process_time()
        out.append(dataclasses.replace(found, derive_s=t1 - t0, bound_s=t2 - t1))
    return out


def simulate_plans(plans: list[Plan], memory_limit: float, prune: bool = True
                   ) -> list[Assessment]:
    """Each plan: pruned by its exact-order memory bound (when ``prune``), else simulated
    (validated); its figures, and the CPU seconds spent."""
    out = []
    for plan in plans:
        if prune:
            t0 = time.process_time()
            try:
                b = plan_bounds(plan, exact_order=True)
            except (PlanError, ScheduleError, ValueError) as exc:
                out.append(Assessment(INVALID, str(exc), bound_s=time.process_time() - t0))
                continue
            if b.memory > memory_limit:
                out.append(Assessment(PRUNED_MEMORY,
                                      _overflow_text(b.memory_parts, b.memory_rank,
                                                     memory_limit, "at least"),
                                      memory_bound=b.memory, bound_s=time.process_time() - t0))
                continue
            bound_s = time.process_time() - t0
        else:
            bound_s = 0.0
        out.append(dataclasses.replace(evaluate_plan(plan, memory_limit), bound_s=bound_s))
    return out


def evaluate_plan(plan: Plan, memory_limit: float) -> Assessment:
    """Simulate ``plan``: its figures against ``memory_limit`` (bytes), or why it is invalid."""
    t0 = time.process_time()
    try:
        r = simulate_plan(plan)
    except (PlanError, ScheduleError, ValueError) as exc:
        return Assessment(INVALID, str(exc), sim_s=time.process_time() - t0)
    return dataclasses.replace(result_row(r, memory_limit), sim_s=time.process_time() - t0)


def result_row(r: PlanResult, memory_limit: float) -> Assessment:
    """A simulated plan's figures, memory the worst rank's; the reason it does not fit."""
    peaks = r.peak_memory
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    parts = r.memory_breakdown[worst]
    fits = peaks[worst] <= memory_limit
    figures = PlanFigures(
        step_time=r.step_time, tokens_per_s_per_gpu=r.tokens_per_s_per_gpu, mfu=r.mfu,
        hfu=r.hfu, bubble_fraction=r.sim.bubble_fraction, bubble_rate=r.sim.bubble_rate,
        peak_memory=peaks[worst], peak_rank=worst, headroom=memory_limit - peaks[worst],
        fits=fits, **{k: parts[k] for k in ("weights", "gradients", "optimizer", "activations",
                                            "buffers")})
    return Assessment(SIMULATED, "" if fits else _overflow_text(parts, worst, memory_limit, ""),
                      figures=figures)


def _overflow_text(parts: dict, rank: int, limit: float, qualifier: str) -> str:
    total = sum(v for k, v in parts.items() if k != "total")
    comps = sorted(((v, k) for k, v in parts.items() if k != "total"), reverse=True)
    shown = " + ".join(f"{k} {v / GiB:.1f}" for v, k in comps if v > 0)
    q = f"{qualifier} " if qualifier else ""
    return (f"rank {rank} needs {q}{total / GiB:.1f} GiB ({shown}), {(total - limit) / GiB:.1f} "
            f"GiB over the {limit / GiB:.1f} GiB limit; largest: {comps[0][1]}")


# equal step time and memory: the layout with the smaller of these first, in this order (the
# dispatchers' names sort as EP_DISPATCHERS does: the all-to-all, Megatron's default, first)
TIE_ORDER = ("cp", "tp", "ep", "ep_dispatcher", "vpp", "pp")


# -- the search --------------------------------------------------------------------------------
@dataclass
class SearchResult:
    space: SearchSpace
    memory_limit: float
    rows: "pd.DataFrame"                    # every enumerated plan, COLUMNS
    plans: dict[str, Plan]                  # key -> plan
    refused: Counter
    timing: dict[str, float]                # CPU seconds by phase, and wall seconds
    top: int = 10
    extra: dict = field(default_factory=dict)

    @property
    def ranked(self) -> "pd.DataFrame":
        """The simulated plans that fit, fastest first. Ties (the same step time, as when cp
        and the micro-batch size trade off exactly) go to the smaller peak memory, then to the
        simpler layout (`TIE_ORDER`: fewer ranks splitting each sequence, each layer, each
        expert set, fewer model chunks), then by key."""
        ok = self.rows[(self.rows["status"] == SIMULATED) & (self.rows["fits"] == True)]  # noqa: E712
        return ok.sort_values(["step_time", "peak_memory", *TIE_ORDER, "key"],
                              kind="mergesort").reset_index(drop=True)

    @property
    def best(self) -> Plan | None:
        ranked = self.ranked
        return self.plans[ranked["key"].iloc[0]] if len(ranked) else None

    @property
    def simulated(self) -> int:
        return int((self.rows["status"] == SIMULATED).sum())

    def counts(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.rows["status"].value_counts().items()}

    def closest(self, k: int = 3) -> "pd.DataFrame":
        """When nothing fits: the plans nearest the limit (simulated peak, else memory bound)."""
        rows = self.rows[self.rows["status"] != INVALID].copy()
        rows["_need"] = rows["peak_memory"].fillna(rows["memory_bound"])
        return rows.sort_values(["_need", "key"]).head(k).drop(columns="_need")


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                   # not on Linux
        return os.cpu_count() or 1


@full_collections_paused()
def search(space: SearchSpace, *, memory_limit: float | None = None, top: int = 10,
           workers: int | None = None, executor: Any = None, prune: bool = True,
           progress: bool = False, timeout: float = 3600.0,
           enumeration: Enumeration | None = None) -> SearchResult:
    """Search ``space``; see the module docstring. ``memory_limit`` in bytes (default: the
    hardware's usable memory, less its reserve and fragmentation); ``prune=False`` simulates every plan (the brute force the tests compare
    with). ``workers`` 1 (the default) runs in this process; an ``executor`` given is used as
    it is. CPython's full collections wait until it returns (:mod:`.collector`)."""
    import pandas as pd

    wall0 = time.perf_counter()
    # default: what tensors may take, the capacity less the reserve over the fragmentation
    limit = float(space.hardware.usable_memory if memory_limit is None else memory_limit)
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    t0 = time.process_time()
    enum = enumerate_plans(space) if enumeration is None else enumeration
    timing = {"enumerate": time.process_time() - t0, "derive": 0.0, "bounds": 0.0,
              "simulate": 0.0}
    plans = enum.plans
    keys = [plan_key(p) for p in plans]
    rows = [PlanRow(PlanConfig.of(p)) for p in plans]
    own_pool = None
    # the candidates are simulated in batches of 2 per worker (1 in this process with
    # workers=1), and a batch is pruned against the plans found before it: the default runs in
    # this process but batches as a pool over every core would, so its counts are those
    # of ``workers=default_workers()``
    batch = 2 * (default_workers() if workers is None else workers)
    workers = 1 if workers is None else workers
    if executor is None and workers > 1 and len(plans) > 1:
        own_pool = executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(),
                                                  initializer=_ignore_sigint)
    try:
        def stream(fn, chunks: list[list[Plan]], *more):
            if executor is None:
                return (fn(c, limit, *more) for c in chunks)
            extra = [[x] * len(chunks) for x in more]
            return executor.map(fn, chunks, [limit] * len(chunks), *extra, timeout=timeout)

        def run(fn, chunks: list[list[Plan]], *more) -> list[list[Assessment]]:
            return list(stream(fn, chunks, *more))

        # bounds, in chunks spread over the workers: one plan of each set that shares its
        # costs and bounds (`bounds_key`), the others given its figures
        firsts: dict = {}
        same = [i if (k := bounds_key(p)) is None else firsts.setdefault(k, i)
                for i, p in enumerate(plans)]
        own = [i for i in range(len(plans)) if same[i] == i]
        size = max(1, min(64, math.ceil(len(own) / (4 * max(1, workers)))))
        chunks = [[plans[i] for i in own[k:k + size]] for k in range(0, len(own), size)]
        bar = progress_bar(total=len(plans), desc="pipesim plan: bounds", unit="plan",
                           disable=not progress)
        found_by: dict[int, Assessment] = {}
        for start, out in zip(range(0, len(own), size), stream(bound_plans, chunks, prune)):
            bar.update(len(out))
            for j, b in enumerate(out):
                timing["derive"] += b.derive_s
                timing["bounds"] += b.bound_s
                found_by[own[start + j]] = b
        for i, first in enumerate(same):
            b = found_by[first]
            if i != first:
                if b.status == INVALID:        # refused again on its own, in its own words
                    b = bound_plans([plans[i]], limit, prune)[0]
                else:
                    b = dataclasses.replace(b, derive_s=0.0, bound_s=0.0)
                bar.update(1)
            rows[i] = rows[i].merged(b)
        candidates = sorted((i for i, r in enumerate(rows) if r.status == CANDIDATE),
                            key=lambda i: (rows[i].step_time_bound, keys[i]))
        batch = 1 if batch <= 2 and executor is None else max(2, batch)
        found: list[tuple[float, str]] = []           # fitting plans' (step, key), sorted
        best_of: dict[str, tuple[float, str]] = {}    # schedule -> best fitting (step, key)
        bar.close()
        bar = progress_bar(total=len(candidates), desc="pipesim plan: candidates (simulated or pruned)", unit="plan",
                           disable=not progress)
        pos = 0
        while pos < len(candidates):
            take = []
            while pos < len(candidates) and len(take) < batch:
                i = candidates[pos]
                pos += 1
                if prune and _cannot_win(rows[i], found, best_of, top):
                    rows[i] = rows[i].merged(Assessment(
                        PRUNED_TIME, f"step-time bound {rows[i].step_time_bound:.4g} s "
                        "exceeds the plans found"))
                    bar.update(1)
                    continue
                take.append(i)
            if not take:
                continue
            per = max(1, math.ceil(len(take) / max(1, workers))) if executor is not None else 1
            groups = [take[k:k + per] for k in range(0, len(take), per)]
            outs = run(simulate_plans, [[plans[i] for i in g] for g in groups], prune)
            for g, out in zip(groups, outs):
                for i, res in zip(g, out):
                    timing["simulate"] += res.sim_s
                    timing["bounds"] += res.bound_s
                    rows[i] = rows[i].merged(res)
                    if res.status == SIMULATED and res.figures.fits:
                        item = (res.figures.step_time, keys[i])
                        found.append(item)
                        s = rows[i].config.schedule
                        if s not in best_of or item < best_of[s]:
                            best_of[s] = item
            found.sort()
            del found[top:]
            bar.update(len(take))
        bar.close()
    finally:
        if own_pool is not None:
            own_pool.shutdown(cancel_futures=True)
    frame = pd.DataFrame([r.record() for r in rows], columns=list(COLUMNS))
    frame["fits"] = frame["fits"].astype("boolean")
    timing["wall"] = time.perf_counter() - wall0
    return SearchResult(space, limit, frame, dict(zip(keys, plans)), enum.refused, timing, top)


def _ignore_sigint() -> None:
    """A pool worker leaves Ctrl-C to the parent (which stops the pool): no traceback each;
    it only searches, so without full collections (:mod:`.collector`)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pause_full_collections()


def _cannot_win(row: PlanRow, found: list, best_of: dict, top: int) -> bool:
    bound = (row.step_time_bound, row.key)
    kth = found[top - 1] if len(found) >= top else None
    own = best_of.get(row.config.schedule)
    return kth is not None and bound > kth and own is not None and bound > own
