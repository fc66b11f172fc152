"""Profile, re-schedule, run: zb-auto from the run's own measured costs.

``pipeexec train --schedule zb-auto --memory-limit X`` trains its first steps with a schedule
whose split backward measures F, I and W of every stage (:func:`profiled_schedule`: ZB-H1; at
vpp 2 ZB-V, or interleaved 1F1B with each backward run as I then W in the looped placement), profiling steps
``2 .. reschedule_after + 1`` (steps 0 and 1 warm up: `pipeexec.config.RESCHEDULE_WARMUP_STEPS`). The stages are cut before the first step, so the
search keeps the profiled schedule's vpp and placement. Then, on every rank at the same step: rank 0 fits a cost model to the
profiled steps as predictions do (:func:`pipeexec.analysis.predict.prediction_costs`: wall
times, or CPU work and the shared cores where the ranks competed), searches zb-auto under the
limit and predicts its step time (the simulator, the executor's rendezvous communication;
under ZeRO-2/3 every candidate, the prediction and the hand-made reference lowered with the
run's sharding, their UNSHARD / REDUCE_GRAD priced from the profiled steps' own, as the
profiled order's prediction is: the figures compare like with like); the
schedule is broadcast as data, validated, and every rank switches to it
(`Trainer.set_schedule`). The log shows the measured step time before, the predicted one, and
the measured steps after. Memory is counted as the calibrated model counts it (on CPU: the
tensors the runtime holds, parameters excluded; on CUDA: allocated bytes).

A prediction is not a measurement (predicted faster, measured slower happens: 57.8 -> 62.5 ms
at vpp 2), so the switch is a trial (:func:`judge_switch`): the searched order runs
``TRIAL_STEPS`` steps, the order it replaced runs as many again, both unprofiled, and the
searched order is kept only if its median step beats the replaced order's by the margin and by
the noise the trial measured, with at least ``JUDGED_STEPS`` counted steps a side; else every
rank stays on the replaced order.
The log gives both figures and the hand-made order the search's margin was compared with
(:func:`pipesim.zb_auto.search.fastest_handcrafted`). A limit below what one microbatch needs
is refused before step 0 (:func:`check_memory_limit`), not at the search.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import pipesim
from pipesim.schedule.action import Action
from pipesim.zb_auto.search import fastest_handcrafted, handcrafted_origin
from pipesim.schedule.io import schedule_from_dict, schedule_to_dict
from pipesim.units import format_bytes

from ..analysis.measured_run import MeasuredRun
from ..analysis.predict import EXECUTOR_COMM, prediction_costs
from ..training.precision import compute_dtype

PROFILED_SCHEDULE = "zb-h1"                 # at vpp 1
PROFILED_V_SCHEDULE = "zbv"                 # at vpp 2, V placement
TRIAL_STEPS = 4                             # steps each order runs in the trial (the first of
                                            # each, right after a switch, is not counted)
JUDGED_STEPS = 2                            # counted steps each side needs to judge a switch


def profiled_schedule(config: Any) -> pipesim.Schedule:
    """The schedule the first steps of a ``--memory-limit`` run train (and profile) with: one
    with a split backward (F, I and W timed apart) on the stages the search will keep."""
    par = config.plan.parallelism
    common = dict(pp=par.pp, microbatches=config.plan.microbatches,
                  recv_lookahead=config.runtime.recv_lookahead)
    if par.vpp == 1:
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
    ``recv_lookahead`` early, processor sharing where the ranks shared cores, ZeRO-2/3's
    actions where the run has them: its sharding, priced from its own rows); a searched order
    must be predicted ``margin`` faster than the fastest hand-made one that fits; (schedule,
    what was decided: ``predicted_s`` is the searched order lowered with the run's sharding,
    as ``predicted_before_s`` is the profiled one, which ran lowered). The schedule returned
    is the plain order: the Trainer lowers what it runs."""
    steps = run.central_steps()
    cal = prediction_costs(run.plan.layout, run, steps)   # with the shared cores, on CPU
    profiled = run.schedule
    sharding = profiled.sharding          # the program that ran: None without ZeRO-2/3
    schedule = pipesim.build_schedule("zb-auto", pp=profiled.pp,
                                      microbatches=profiled.num_microbatches,
                                      vpp=profiled.vpp,
                                      placement=profiled.placement_kind,
                                      costs=cal.costs, memory_limit=memory_limit,
                                      comm=EXECUTOR_COMM, lookahead=recv_lookahead,
                                      recv_lookahead=recv_lookahead, cores=cal.cores,
                                      margin=margin, sharding=sharding)
    predicted = pipesim.simulate(schedule.with_sharding(sharding), cal.costs, comm=EXECUTOR_COMM,
                                 cores=cal.cores)
    reference = fastest_handcrafted(profiled.pp, profiled.num_microbatches, cal.costs,
                                    memory_limit, vpp=profiled.vpp,
                                    placement=profiled.placement_kind, comm=EXECUTOR_COMM,
                                    lookahead=recv_lookahead, cores=cal.cores, sharding=sharding)
    before = pipesim.simulate(run.schedule, cal.costs, comm=EXECUTOR_COMM, cores=cal.cores)
    makespans = run.makespans()
    info = {"profiled": run.schedule.name, "steps": list(steps),
            "measured_before_s": statistics.mean(makespans[s] for s in steps),
            "predicted_before_s": before.makespan, "predicted_s": predicted.makespan,
            "predicted_peak_bytes": list(predicted.peak_memory), "memory_limit": memory_limit,
            "vpp": schedule.vpp, "placement": schedule.placement_kind,
            "sharding": None if sharding is None else sharding.to_dict(),
            "margin": margin, "handcrafted": handcrafted_origin(schedule),
            "margin_reference": None if reference is None else reference[0],
            "margin_reference_predicted_s": None if reference is None else reference[1],
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
            config = trainer.config
            schedule, info = search_from_run(run, memory_limit, config.runtime.recv_lookahead,
                                             config.layout.reschedule_margin)
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
            f"{info['measured_before_s'] * 1e3:.1f} ms of pipeline a step (predicted from their "
            f"own costs {info['predicted_before_s'] * 1e3:.1f} ms; profiled steps carry the "
            f"profiler's overhead); searched under {format_bytes(memory_limit)} a rank: "
            f"predicted {info['predicted_s'] * 1e3:.1f} ms of pipeline"
            + (f" (ZeRO-{info['sharding']['zero']}'s gathers and reductions included, as in "
               "the profiled order's)" if info.get("sharding") else "")
            + f", peak "
            f"{format_bytes(max(info['predicted_peak_bytes']))}, vpp {info['vpp']} "
            f"{info['placement']}"
            + (f", {info['handcrafted']}'s order (a searched one must be predicted "
               f"{info['margin']:.0%} faster)" if info["handcrafted"] else ", a searched order")
            + "; switching now")
    return info


def settled(step_times: list[float]) -> float:
    """The median step of one side of the trial, its first step left out when there are more
    (the step right after a switch pays for the new runtime: 2-4x a step on a small CPU run)."""
    return statistics.median(step_times[1:] if len(step_times) > 1 else step_times)


def counted(step_times: list[float]) -> list[float]:
    """One side's steps that count: all but the first when there are more (:func:`settled`)."""
    return step_times[1:] if len(step_times) > 1 else list(step_times)


def spread(step_times: list[float]) -> float:
    """The noise one side of the trial measured: the range of its counted steps over their
    median (0 for a single step, which measures no noise at all)."""
    steps = counted(step_times)
    return (max(steps) - min(steps)) / statistics.median(steps) if len(steps) > 1 else 0.0


def keep_searched(before_s: list[float], trial_s: list[float], margin: float) -> bool:
    """Keep the searched order when each side has ``JUDGED_STEPS`` counted steps and the
    searched order's settled step (:func:`settled`) beats the replaced order's by ``margin``
    and by the noise the trial measured (the larger side's :func:`spread`), each a fraction of
    the replaced order's step: one step a side (a predicted 110 ms order measured 129 vs 98 ms)
    decides nothing, and the run stays on the order it profiled."""
    if min(len(counted(before_s)), len(counted(trial_s))) < JUDGED_STEPS:
        return False
    need = max(margin, spread(before_s), spread(trial_s))
    return settled(trial_s) < settled(before_s) * (1 - need)


def trial_steps(steps: int, switch_at: int) -> int:
    """How many steps each side of the trial gets: ``TRIAL_STEPS``, fewer when the run is
    shorter (0: too few steps after the switch to measure both orders)."""
    return max(0, min(TRIAL_STEPS, (steps - switch_at) // 2))


def judge_switch(trainer: Any, info: dict, trial_s: list[float], baseline_s: list[float],
                 previous: pipesim.Schedule, searched: pipesim.Schedule,
                 log: Callable[[str], None] | None = None) -> dict:
    """Collective, at the same step on every rank, after the trial: ``trial_s`` the searched
    order's step times, ``baseline_s`` those of the order it replaced, run again right after
    (both unprofiled: profiled steps carry the profiler's cost, ~40% on a small CPU run, and
    would flatter any order measured against them). Rank 0 decides from its step times (every
    rank runs the same steps), every rank hears it and runs the kept order from the next step
    on. Returns the decision's record (also put in ``info["trial"]``)."""
    topo = trainer.topology
    margin = info["margin"]
    decision = [keep_searched(baseline_s, trial_s, margin)]
    if topo.world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    kept = bool(decision[0])
    trainer.set_schedule(searched if kept else previous)
    record = {"before_s": settled(baseline_s), "measured_s": settled(trial_s),
              "steps": len(trial_s), "kept": kept,
              "noise": max(spread(baseline_s), spread(trial_s)),
              "judged": min(len(counted(baseline_s)), len(counted(trial_s))) >= JUDGED_STEPS,
              "reverted_to": None if kept else previous.name, "margin": margin,
              "margin_reference": info.get("margin_reference")}
    info["trial"] = record
    if log is not None and topo.rank == 0:
        ref = info.get("margin_reference")
        log(f"zb-auto: the searched order measured {record['measured_s'] * 1e3:.1f} ms a step "
            f"({_counted(trial_s)}) against {record['before_s'] * 1e3:.1f} ms for "
            f"{previous.name}, the order it replaced, run again after it "
            f"({_counted(baseline_s)}); it must be {max(margin, record['noise']):.0%} faster "
            f"(the margin {margin:.0%}, or the noise the trial measured, the larger)"
            + ("" if record["judged"] else
               f"; {len(trial_s)} step(s) a side is too few to judge: each side needs "
               f"{JUDGED_STEPS + 1}, so {2 * (JUDGED_STEPS + 1)} steps after the switch "
               "(raise --steps)")
            + (f" (the search's margin was compared with {ref}'s order, the fastest hand-made "
               f"one that fits, predicted {info['margin_reference_predicted_s'] * 1e3:.1f} ms)"
               if ref else " (no hand-made order fits the limit)")
            + (": kept, switching to it again" if kept else f": keeping {previous.name}"))
    return record


def _counted(step_times: list[float]) -> str:
    n = len(step_times)
    return f"median of {n - 1} after a first step not counted" if n > 1 else "1 step"


def one_microbatch_floor(trainer: Any) -> float:
    """Bytes one microbatch holds on a rank at the least: a stage's input activation
    (micro_batch_size x seq_len x hidden values of the compute dtype; hidden read from the
    embedding of the stages here when they have one, a Hugging Face model's own size)."""

    plan = trainer.config.plan
    hidden = plan.model.hidden
    for stage in trainer.stages.values():
        emb = next((mod for mod in stage.modules() if isinstance(mod, torch.nn.Embedding)), None)
        if emb is not None:
            hidden = emb.embedding_dim
            break
    par = plan.parallelism
    element = torch.empty((), dtype=compute_dtype(par.precision)).element_size()
    return float(par.micro_batch_size * plan.model.seq_length * hidden * element)


def check_memory_limit(trainer: Any, memory_limit: float) -> None:
    """Collective, before step 0: refuse a limit below one microbatch's floor (rank 0's, which
    holds the first stage and its embedding), on every rank at once, before anything runs."""
    topo = trainer.topology
    floor = [one_microbatch_floor(trainer)]
    if topo.world_size > 1:
        dist.broadcast_object_list(floor, src=0)
    if memory_limit < floor[0]:
        raise pipesim.ScheduleError(
            f"zb-auto: memory_limit {memory_limit:g} bytes is below what one microbatch needs on "
            f"a rank (at least {floor[0]:g} bytes: its input activation, micro_batch_size x "
            f"seq_len x hidden); refused before step 0, raise --memory-limit")
