"""Sweep schedules x pp x vpp x microbatches (x microbatch size) through the simulator.

Each configuration becomes one row. A configuration a builder rejects is kept with
``status = "invalid"`` and the builder's reason; one that simulates but breaks a limit is kept
with ``status = "infeasible"`` and a reason naming the limit, the rank and both numbers, so a
table of results also says why the missing configurations are missing.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..plan.costs import CostModel
from .engine import simulate
from ..errors import ScheduleError
from ..progress import progress_bar
from ..schedule.registry import build_schedule, schedule_names
from ..units import format_bytes

if TYPE_CHECKING:
    import pandas as pd

CostFactory = Callable[[int, int], CostModel]   # (num_stages, micro_batch_size) -> CostModel

SWEEP_COLUMNS = ("schedule", "pp", "vpp", "microbatches", "micro_batch_size", "status", "reason",
                 "makespan", "bubble_fraction", "bubble_rate", "peak_memory", "peak_memory_rank",
                 "peak_inflight", "samples_per_s")


def sweep(schedules: Sequence[str], pp: Iterable[int], vpp: Iterable[int],
          microbatches: Iterable[int], micro_batch_sizes: Iterable[int] = (1,), *,
          costs: CostModel | CostFactory | None = None, memory_limit: float | None = None,
          inflight_limit: int | None = None, comm: str = "async", step_tail: bool = False,
          dp: int = 1, recv_lookahead: int = 0, cores: float | None = None,
          progress: bool = False) -> "pd.DataFrame":
    """Simulate every combination; return a DataFrame with ``SWEEP_COLUMNS``.

    ``costs`` is one CostModel for every configuration, or a function
    ``(num_stages, micro_batch_size) -> CostModel`` (e.g. wrapping
    :meth:`CostModel.transformer`); default uniform F=1, B=2. ``memory_limit`` (bytes) bounds
    each rank's peak memory, ``inflight_limit`` its peak in-flight microbatches.
    ``comm``, ``recv_lookahead`` and ``cores`` are passed on to `build_schedule` / `simulate`.
    ``samples_per_s`` is ``microbatches * micro_batch_size / makespan``.
    """
    import pandas as pd

    unknown = [n for n in schedules if n not in schedule_names()]
    if unknown:
        raise ScheduleError(f"unknown schedule name(s) {', '.join(map(repr, unknown))}; known: "
                            f"{', '.join(schedule_names())}")
    if costs is None:
        costs = CostModel.uniform(1.0, 2.0)
    factory: CostFactory = costs if callable(costs) else (lambda n, b: costs)
    configs = list(itertools.product(schedules, pp, vpp, microbatches, micro_batch_sizes))
    rows: list[dict[str, Any]] = []
    for name, p, v, m, b in progress_bar(configs, desc="pipesim sweep", unit="config", disable=not progress):
        row: dict[str, Any] = {"schedule": name, "pp": p, "vpp": v, "microbatches": m,
                               "micro_batch_size": b, "status": "ok", "reason": ""}
        rows.append(row)
        try:
            schedule = build_schedule(name, pp=p, microbatches=m, vpp=v,
                                      recv_lookahead=recv_lookahead)
            schedule.validate()
            # A cost factory refuses what the model can't be cut into (more stages than layers).
            stage_costs = factory(p * v, b)
        except (ScheduleError, ValueError) as exc:
            row.update(status="invalid", reason=str(exc))
            continue
        result = simulate(schedule, stage_costs, comm=comm, step_tail=step_tail, dp=dp,
                          cores=cores)
        mem = result.peak_memory
        worst = max(range(p), key=mem.__getitem__)
        row.update(makespan=result.makespan, bubble_fraction=result.bubble_fraction,
                   bubble_rate=result.bubble_rate, peak_memory=mem[worst], peak_memory_rank=worst,
                   peak_inflight=max(result.peak_inflight),
                   samples_per_s=m * b / result.makespan if result.makespan > 0 else float("inf"))
        failed = []
        if memory_limit is not None and mem[worst] > memory_limit:
            # binary units, as `pipesim plan` and `simulate --plan` state memory
            failed.append(f"memory limit: rank {worst} peaks at {format_bytes(mem[worst])} > "
                          f"{format_bytes(memory_limit)}")
        if inflight_limit is not None and max(result.peak_inflight) > inflight_limit:
            r = max(range(p), key=result.peak_inflight.__getitem__)
            failed.append(f"in-flight limit: rank {r} holds {result.peak_inflight[r]} "
                          f"microbatches > {inflight_limit}")
        if failed:
            row.update(status="infeasible", reason="; ".join(failed))
    frame = pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))
    # Whole numbers stay whole even where invalid rows leave gaps.
    return frame.astype({"peak_memory_rank": "Int64", "peak_inflight": "Int64"})
