"""Sound lower bounds on a plan's peak memory and step time, without simulating it.

Both are never above what :func:`pipesim.sim.plan_report.simulate_plan` reports, so a plan whose
memory bound exceeds the limit cannot fit, and one whose time bound exceeds a simulated plan's
step time cannot beat it: pruning on them never drops the best plan (the property test
compares the search with brute force).

Memory, per pipeline rank: its static bytes (weights, gradients, optimizer state of its stages,
its transient buffers) plus the activation peak of its compute order replayed with the
simulator's memory rules (F adds the stage's activations, I frees all but W's share, W that
share, B all). The replay needs no timing: a rank's own operations are sequential, and the one
thing timing adds, receive buffers, only adds. (``exact_order=False``: one microbatch of the
rank's largest stage, without building the schedule.)

Step time, per rank ``r``: it cannot start before microbatch 0's forward has crossed every
stage before its first one (their F times and the point-to-point transfers between ranks), it
then computes ``m * (F + I + W)`` of each of its stages one after another, and after its last
action comes its step tail (exposed data-parallel communication, optimizer step). Under
ZeRO-2/3 its last row also ends no sooner than its sharding lane has run the fewest of its
UNSHARD / REDUCE_GRAD actions the program can hold (``lane_r``, one at a time). The step is
the latest rank: ``max_r max(head_r + busy_r, lane_r) + tail_r`` (the closed-form bubble
``(p - 1) F`` of 1F1B on the last rank is this head).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from ..errors import ScheduleError
from ..plan.derive import PlanCosts, rank_parts
from ..plan.plan import Plan
from ..schedule.registry import schedule_info, schedule_part_runs
from ..schedule.schedule import Schedule


@dataclass(frozen=True)
class Bounds:
    step_time: float            # seconds, <= the simulated step time
    memory: float               # bytes, <= the simulated peak of the worst rank
    memory_rank: int            # the rank the memory bound comes from
    memory_parts: dict          # that rank: weights, gradients, optimizer, buffers, activations
    compute_time: float         # the busiest rank's compute, seconds (no bubble, no tail)


def plan_bounds(plan: Plan, derived: PlanCosts | None = None, *, exact_order: bool = True
                ) -> Bounds:
    derived = plan.derive() if derived is None else derived
    costs = derived.costs
    par = plan.parallelism
    n, m = par.num_stages, par.microbatches
    times = costs.compute_times(n)
    f, i, w = times["F"], times["I"], times["W"]
    stages = rank_parts(plan, n)
    owner = [0] * n
    for r, sts in enumerate(stages):
        for st in sts:
            owner[st] = r
    nbytes = costs.stage_values("p2p_bytes", n)
    # prefix[st]: the earliest time stage st can start microbatch 0's forward
    prefix = [0.0] * n
    for st in range(1, n):
        hop = costs.transfer_time(nbytes[st - 1]) if owner[st] != owner[st - 1] else 0.0
        prefix[st] = prefix[st - 1] + f[st - 1] + hop
    # microbatches each rank runs through each of its parts: m each, unless stages are copies
    # that share the microbatches (dualpipe: part r for the first half, its copy the second)
    runs = _part_runs(plan, stages, m)
    lanes = _lane_busy(plan, costs, runs)
    step = compute = 0.0
    for r, sts in enumerate(stages):
        busy = sum(k * (f[st] + i[st] + w[st]) for st, k in runs[r].items())
        tail = derived.tail[r].seconds
        head = min(prefix[st] for st in sts)
        step = max(step, max(head + busy, lanes[r]) + tail)
        compute = max(compute, busy)

    act = costs.stage_values("activation_bytes", n)
    share = costs.stage_values("weight_grad_fraction", n)
    peaks = _activation_peaks(plan, act, share, stages) if exact_order else \
        [max(act[st] for st in sts) for sts in stages]
    best, best_rank, parts = -1.0, 0, {}
    for r, sts in enumerate(stages):
        row = {k: sum(derived.stage_memory[st][k] for st in sts)
               for k in ("weights", "gradients", "optimizer")}
        row["buffers"] = derived.rank_buffers[r]
        row["activations"] = peaks[r]
        total = sum(row.values())
        if total > best:
            best, best_rank, parts = total, r, row
    return Bounds(step, best, best_rank, parts, compute)


def bounds_key(plan: Plan) -> Hashable | None:
    """Plans with equal keys have equal derived costs and cheap bounds (``exact_order=False``):
    a plan's costs depend on its schedule only through which parts each rank holds and how many
    microbatches it runs through each (gpipe, 1f1b, zb-h1 and zb-h2 share theirs, as do the V
    schedules, and interleaved and looped-bfs at one vpp), so a search derives each once. None
    for a plan holding a Schedule value (or an option that cannot be hashed)."""
    if isinstance(plan.schedule, Schedule):
        return None
    par = plan.parallelism
    try:
        runs = schedule_part_runs(plan.schedule_name, par.pp, par.vpp, par.microbatches)
    except ScheduleError:
        return None
    # under ZeRO-2/3 the lane bound also counts the schedule's gathers (`_lane_busy`): zbv and
    # dualpipev share their parts and runs but not how many UNSHARDs a microbatch takes
    lane = None if par.sharding is None else _gathers_per_microbatch(plan)
    key = (dataclasses.replace(plan, schedule=""), tuple(tuple(parts.items()) for parts in runs),
           lane)
    try:
        hash(key)
    except TypeError:                  # an option value that cannot be a key: on its own
        return None
    return key


def _part_runs(plan: Plan, stages: list[list[int]], m: int) -> list[dict[int, int]]:
    """Per rank, part -> how many microbatches the rank runs through it."""
    schedule = plan.schedule if isinstance(plan.schedule, Schedule) else None
    if schedule is None and len({st for sts in stages for st in sts}) < sum(map(len, stages)):
        par = plan.parallelism         # a part held twice: the schedule's copies share the runs
        try:
            return list(schedule_part_runs(plan.schedule_name, par.pp, par.vpp, m))
        except ScheduleError:
            schedule = plan.build_schedule()
    if schedule is None or not schedule.has_copies:
        return [{st: m for st in sts} for sts in stages]
    out: list[dict[int, int]] = []
    for r in range(schedule.pp):
        runs: dict[int, int] = {}
        for a in schedule.compute_parts(r):
            if a.op == "F":
                p = schedule.stage_part(a.stage)
                runs[p] = runs.get(p, 0) + 1
        out.append(runs)
    return out


def _gathers_per_microbatch(plan: Plan) -> int:
    """The fewest ZeRO-3 UNSHARDs a microbatch of a part takes under the plan's schedule: one
    before each of its computations, F and a backward (2), F, I and W where every backward is
    split (3), one where a forward and a backward overlap (the pair may share it)."""
    if isinstance(plan.schedule, Schedule):
        overlapped, split = plan.schedule.has_overlaps, False
    else:
        info = schedule_info(plan.schedule_name)
        overlapped, split = info.overlapped, info.split_backward
    return 1 if overlapped else 3 if split else 2


def _lane_busy(plan: Plan, costs, runs: list[dict[int, int]]) -> list[float]:
    """Per rank, the fewest seconds its ZeRO actions keep its sharding lane busy (they run one
    at a time, so its last row ends no sooner): under ZeRO-3 an UNSHARD before each
    computation (`pipesim.schedule.sharding.insert_sharding`), so two a microbatch of each
    part (its F and a backward, each an action of its own; three where the schedule splits
    every backward into I and W, `BuilderInfo.split_backward`), one where it overlaps a forward
    with a backward (the pair may share one); and a
    REDUCE_GRAD a part once a step, a microbatch once a microbatch. 0 without ZeRO-2/3's
    actions."""
    sharding = plan.parallelism.sharding
    if sharding is None:
        return [0.0] * len(runs)
    n = plan.parallelism.num_stages
    unshard = costs.stage_values("unshard", n)
    reduce = costs.stage_values("reduce_grad", n)
    per_mb = sharding.grad_reduce == "per_microbatch"
    gathers = _gathers_per_microbatch(plan)
    return [sum(gathers * k * unshard[st] + (k if per_mb else 1) * reduce[st]
                for st, k in parts.items()) for parts in runs]


def _compute_profile(schedule: Schedule) -> tuple[np.ndarray, ...]:
    """Every rank's compute parts in order, as read-only arrays over all ranks: the model part
    each computes (a copy of a part holds what the part holds), whether it is an F, B, I or W,
    and where each rank's run starts and ends (kept with the schedule: ``Schedule.derived``)."""
    parts: list[int] = []
    ops: list[str] = []
    bounds = [0]
    for r in range(schedule.pp):
        for op, st, _mb in schedule.compute_parts(r):
            ops.append(op)
            parts.append(schedule.stage_part(st))
        bounds.append(len(ops))
    names = np.array(ops)
    out = (np.array(parts, dtype=np.int64), names == "F", names == "B", names == "I",
           names == "W", np.array(bounds, dtype=np.int64))
    for a in out:
        a.flags.writeable = False
    return out


def _activation_peaks(plan: Plan, act: list[float], share: list[float],
                      stages: list[list[int]]) -> list[float]:
    """Per rank, the peak of activations held along its compute order (the memory model's rules,
    receive buffers left out): F adds its part's activations, B frees them, I all but the
    weight gradient's share, W that share; the held bytes summed in order from 0, rank by
    rank, so the peaks are those of adding them one by one."""
    schedule = plan.build_schedule()
    parts, is_f, is_b, is_i, is_w, bounds = schedule.derived(_compute_profile)
    a = np.asarray(act, dtype=float)[parts]
    s = np.asarray(share, dtype=float)[parts]
    delta = np.where(is_f, a, 0.0)
    delta = np.where(is_b, -a, delta)
    delta = np.where(is_i, -(a * (1.0 - s)), delta)
    delta = np.where(is_w, -(a * s), delta)
    peaks = []
    for r in range(schedule.pp):
        lo, hi = bounds[r], bounds[r + 1]
        # frees only lower what is held: the peak is the largest running sum (or nothing)
        peaks.append(max(0.0, float(np.cumsum(delta[lo:hi]).max())) if hi > lo else 0.0)
    return peaks
