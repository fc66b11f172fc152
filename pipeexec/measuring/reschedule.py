"""Profile, re-schedule, run: zb-auto from the run's own measured costs.

``pipeexec train --schedule zb-auto --memory-limit X`` trains its first steps with a schedule
whose split backward measures F, I and W of every stage (:func:`profiled_schedule`: ZB-H1; at
vpp 2 ZB-V, or interleaved 1F1B with each backward run as I then W in the looped placement), profiling steps
``1 .. reschedule_after`` (step 0 warms up). The stages are cut before the first step, so the
search keeps the profiled schedule's vpp and placement. Then, on every rank at the same step: rank 0 fits a cost model to the
profiled steps as predictions do (:func:`pipeexec.analysis.predict.prediction_costs`: wall
times, or CPU work and the shared cores where the ranks competed), searches zb-auto under the
limit and predicts its step time (the simulator, the executor's rendezvous communication); the
schedule is broadcast as data, validated, and every rank switches to it
(`Trainer.set_schedule`). The log shows the measured step time before, the predicted one, and
the measured steps after. Memory is counted as the calibrated model counts it (on CPU: the
tensors the runtime holds, parameters excluded; on CUDA: allocated bytes).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import pipesim
from pipesim.schedule.action import Action
from pipesim.search.zb_auto import handcrafted_origin
from pipesim.schedule.io import schedule_from_dict, schedule_to_dict

from ..analysis.measured import MeasuredRun
from ..analysis.predict import EXECUTOR_COMM, prediction_costs

PROFILED_SCHEDULE = "zb-h1"                 # at vpp 1
PROFILED_V_SCHEDULE = "zbv"                 # at vpp 2, V placement


def profiled_schedule(config: Any) -> pipesim.Schedule:
    """The schedule the first steps of a ``--memory-limit`` run train (and profile) with: one
    with a split backward (F, I and W timed apart) on the stages the search will keep."""
    common = dict(pp=config.pp, microbatches=config.microbatches,
                  recv_lookahead=config.recv_lookahead)
    if config.vpp == 1:
        return pipesim.build_schedule(PROFILED_SCHEDULE, **common).validate()
    if (config.placement or "v") == "v":
        return pipesim.build_schedule(PROFILED_V_SCHEDULE, vpp=2, **common).validate()
    # looped at vpp 2: no handcrafted schedule splits the backward there, so interleaved 1F1B
    # with each B run as I then W at once (the same order and memory, both halves timed)
    base = pipesim.build_schedule("interleaved", vpp=2, **common)
    split = [[part for a in base.compute_order(r)
              for part in ((Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch))
                           if a.op == "B" else (a,))] for r in range(base.pp)]
    return base.with_orders(split, name="interleaved (I+W)").validate()


def search_from_run(run: MeasuredRun, memory_limit: float, recv_lookahead: int = 1,
                    margin: float = 0.0) -> tuple[pipesim.Schedule, dict]:
    """zb-auto for ``run``'s layout from its measured costs, searched and predicted as
    `pipeexec.analysis.predict` predicts the executor (rendezvous transfers, receives posted
    ``recv_lookahead`` early, processor sharing where the ranks shared cores); a searched
    order must be predicted ``margin`` faster than the fastest hand-made one that fits;
    (schedule, what was decided)."""
    steps = run.central_steps()
    cal = prediction_costs(run.plan.layout, run, steps)   # with the shared cores, on CPU
    profiled = run.schedule
    schedule = pipesim.build_schedule("zb-auto", pp=profiled.pp,
                                      microbatches=profiled.num_microbatches,
                                      vpp=profiled.vpp,
                                      placement=profiled.placement_kind,
                                      costs=cal.costs, memory_limit=memory_limit,
                                      comm=EXECUTOR_COMM, lookahead=recv_lookahead,
                                      recv_lookahead=recv_lookahead, cores=cal.cores,
                                      margin=margin)
    predicted = pipesim.simulate(schedule, cal.costs, comm=EXECUTOR_COMM, cores=cal.cores)
    before = pipesim.simulate(run.schedule, cal.costs, comm=EXECUTOR_COMM, cores=cal.cores)
    makespans = run.makespans()
    info = {"profiled": run.schedule.name, "steps": list(steps),
            "measured_before_s": statistics.mean(makespans[s] for s in steps),
            "predicted_before_s": before.makespan, "predicted_s": predicted.makespan,
            "predicted_peak_bytes": list(predicted.peak_memory), "memory_limit": memory_limit,
            "vpp": schedule.vpp, "placement": schedule.placement_kind,
            "margin": margin, "handcrafted": handcrafted_origin(schedule),
            "schedule": schedule_to_dict(schedule)}
    return schedule, info


def reschedule(trainer: Any, session: Any, memory_limit: float,
               log: Callable[[str], None] | None = None) -> dict:
    """Collective: gather the profiled steps, search on rank 0, switch every rank."""
    run = session.finish(trainer)            # the MeasuredRun on global rank 0, else None
    topo = trainer.topology
    payload: list = [None]
    if topo.rank == 0:
        try:
            schedule, info = search_from_run(run, memory_limit, trainer.config.recv_lookahead,
                                             trainer.config.reschedule_margin)
            payload = [{"info": info}]
        except pipesim.ScheduleError as exc:     # every rank must hear it, or they would hang
            payload = [{"error": str(exc)}]
    if topo.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise pipesim.ScheduleError(f"zb-auto after profiling: {payload[0]['error']}")
    schedule = schedule_from_dict(payload[0]["info"]["schedule"], source="zb-auto search")
    trainer.set_schedule(schedule.validate())
    info = payload[0]["info"]
    if log is not None and topo.rank == 0:
        log(f"zb-auto: profiled {info['profiled']} steps {info['steps']}: measured "
            f"{info['measured_before_s'] * 1e3:.1f} ms a step (predicted "
            f"{info['predicted_before_s'] * 1e3:.1f} ms); searched under "
            f"{memory_limit:g} bytes a rank: predicted {info['predicted_s'] * 1e3:.1f} ms, "
            f"peak {max(info['predicted_peak_bytes']):g} bytes, vpp {info['vpp']} "
            f"{info['placement']}"
            + (f", {info['handcrafted']}'s order (a searched one must be predicted "
               f"{info['margin']:.0%} faster)" if info["handcrafted"] else ", a searched order")
            + "; switching now")
    return info
