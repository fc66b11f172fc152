"""zb-auto: Zero Bubble's automatic schedule (Qi et al., ICLR 2024, "Zero Bubble Pipeline
Parallelism", section 3: the heuristic that ZB-1p and ZB-2p come from).

Given a cost model (per-stage F, I, W seconds, the p2p transfer time, activation bytes and the
``weight_grad_fraction`` kept from I to W) and a per-rank memory limit, it list-schedules the
F / I / W passes of every rank in time order and returns the best order that its variants find:

* a rank that is free runs, in this order of preference: an I whose gradient is there (keeps
  memory low and the critical path moving), an F whose input is there and whose activations fit
  under the limit, and otherwise a pending W (it fills what would be a bubble, and frees the
  share of memory W needs);
* the variants (kept when the simulator's step time is the best, and its peak memory under the
  limit): F before I when both are ready or not; W only when it fits before the next known
  arrival, or whenever the rank would wait; no cap on warm-up forwards, or 1F1B's p - r, or
  ZB-2p's 2(p - r) - 1;
* the handcrafted 1F1B, ZB-H1 and ZB-H2 orders compete as well, so the result is never slower
  than one of them that fits the limit.

Memory is counted as the simulator counts it (:mod:`pipesim.memory`): static bytes, plus a
stage's ``activation_bytes`` from the start of each F, minus (1 - weight_grad_fraction) of it at
the end of I and the rest at the end of W, plus the received gradient's buffer while its I runs.
``memory_limit = pp * activation_bytes`` is ZB-1p's budget, twice that ZB-2p's. The candidates
are simulated with the same cost model (and the ``comm`` mode and receive ``lookahead`` the
schedule will run with: options) and only those whose peak fits are kept, so the returned
schedule's simulated peak never exceeds the limit.

One chunk per rank (vpp == 1, looped placement), as in the paper.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import product

from ...errors import ScheduleError
from ..action import F, I, W, Action
from ..placement import LOOPED
from ..registry import register
from ..schedule import Schedule
from .simple import require_vpp

VARIANTS = tuple(product((True, False), ("fit", "eager"), ("none", "1f1b", "zb-2p")))
HANDCRAFTED = ("1f1b", "zb-h1", "zb-h2")


def _limits(memory_limit, pp: int) -> list[float]:
    if memory_limit is None:
        return [math.inf] * pp
    if isinstance(memory_limit, (int, float)) and not isinstance(memory_limit, bool):
        values = [float(memory_limit)] * pp
    elif isinstance(memory_limit, Sequence) and len(memory_limit) == pp:
        values = [float(x) for x in memory_limit]
    else:
        raise ScheduleError(f"zb-auto: memory_limit must be a number of bytes or one per rank "
                            f"(pp = {pp}), got {memory_limit!r}")
    for r, v in enumerate(values):
        if not v > 0:
            raise ScheduleError(f"zb-auto: memory_limit of rank {r} must be > 0 bytes, got {v}")
    return values


def greedy_order(pp: int, m: int, costs, limits: Sequence[float], prefer_i: bool, fill: str,
                 cap: str) -> list[list[Action]]:
    """One variant of the heuristic: per rank, the F / I / W order it schedules."""
    times = costs.compute_times(pp)
    tf, ti, tw = times[F], times[I], times[W]
    nbytes = costs.stage_values("p2p_bytes", pp)
    act = costs.stage_values("activation_bytes", pp)
    keep = [f * a for f, a in zip(costs.stage_values("weight_grad_fraction", pp), act)]
    static_stage = costs.stage_values("stage_static_bytes", pp)
    mem = [s + t for s, t in zip(costs.rank_static_bytes(pp), static_stage)]
    down = [costs.transfer_time(nbytes[s]) for s in range(pp)]          # stage s -> s + 1
    buf = [nbytes[s] if s < pp - 1 else 0.0 for s in range(pp)]         # gradient buffer at I
    caps = {"none": [m] * pp, "1f1b": [pp - r for r in range(pp)],
            "zb-2p": [2 * (pp - r) - 1 for r in range(pp)]}[cap]
    for r in range(pp):
        if mem[r] + act[r] + buf[r] > limits[r]:
            raise ScheduleError(
                f"zb-auto: memory_limit {limits[r]:g} bytes on rank {r} is below what one "
                f"microbatch needs there ({mem[r]:g} static + {act[r]:g} activations "
                f"+ {buf[r]:g} gradient buffer)")
    nf, ni, nw = [0] * pp, [0] * pp, [0] * pp
    f_end = [[None] * m for _ in range(pp)]
    i_end = [[None] * m for _ in range(pp)]
    free = [0.0] * pp
    blocked = [False] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]

    def ready(r: int, op: str) -> float | None:
        """When the input of the next ``op`` of rank r arrives; None while not yet known."""
        if op == F:
            if r == 0:
                return 0.0
            t = f_end[r - 1][nf[r]]
            return None if t is None else t + down[r - 1]
        if r == pp - 1:
            return f_end[r][ni[r]]
        t = i_end[r + 1][ni[r]]
        return None if t is None else t + down[r]

    def run(r: int, op: str, start: float) -> None:
        if op == F:
            end, k = start + tf[r], nf[r]
            f_end[r][k] = end
            nf[r] += 1
            mem[r] += act[r]
        elif op == I:
            end, k = start + ti[r], ni[r]
            i_end[r][k] = end
            ni[r] += 1
            mem[r] -= act[r] - keep[r]
        else:
            end, k = start + tw[r], nw[r]
            nw[r] += 1
            mem[r] -= keep[r]
        free[r] = end
        orders[r].append(Action(op, r, k))
        for q in range(pp):
            blocked[q] = False

    while True:
        live = [r for r in range(pp) if nw[r] < m]
        if not live:
            break
        awake = [r for r in live if not blocked[r]]
        if not awake:
            # Every rank waits on something not scheduled yet: the earliest one with a W runs it.
            r = min((r for r in live if nw[r] < ni[r]), key=lambda q: (free[q], q), default=None)
            if r is None:
                raise ScheduleError(f"zb-auto: no rank can move under memory_limit {list(limits)}; "
                                    "raise the limit")
            run(r, W, free[r])
            continue
        r = min(awake, key=lambda q: (free[q], q))
        e = free[r]
        can_f = nf[r] < m and nf[r] - nw[r] < caps[r] and mem[r] + act[r] + buf[r] <= limits[r]
        can_i = ni[r] < nf[r]
        fr = ready(r, F) if can_f else None
        ir = ready(r, I) if can_i else None
        f_now = fr is not None and fr <= e
        i_now = ir is not None and ir <= e
        if i_now and (prefer_i or not f_now):
            run(r, I, e)
        elif f_now:
            run(r, F, e)
        elif i_now:
            run(r, I, e)
        else:
            known = [t for t in (fr, ir) if t is not None]
            nxt = min(known) if known else None
            has_w = nw[r] < ni[r]
            if has_w and (fill == "eager" or (nxt is not None and e + tw[r] <= nxt)
                          or (nf[r] < m and not can_f)):
                run(r, W, e)
            elif nxt is not None:
                free[r] = nxt
            else:
                blocked[r] = True
    return orders


def zb_auto_schedule(pp: int, microbatches: int, costs=None, memory_limit=None, *,
                     forward_only: bool = False, comm: str = "async",
                     lookahead: int = 0) -> Schedule:
    """The best of the heuristic's variants (see the module docstring), each simulated with
    ``comm`` (a `pipesim.simulate` mode) and its receives posted ``lookahead`` computations
    early, as the schedule will run."""
    from ...costs import CostModel
    from ...engine import simulate
    from ..registry import build_schedule

    costs = CostModel() if costs is None else costs
    if not isinstance(costs, CostModel):
        raise ScheduleError(f"zb-auto: costs must be a pipesim.CostModel, got {type(costs).__name__}")
    try:
        costs.check_shape(pp, pp)
    except ValueError as exc:
        raise ScheduleError(f"zb-auto: {exc} (one stage per rank)") from None
    limits = _limits(memory_limit, pp)
    best = None
    candidates = [Schedule(pp, 1, microbatches, LOOPED,
                           greedy_order(pp, microbatches, costs, limits, prefer_i, fill, cap),
                           name="zb-auto") for prefer_i, fill, cap in VARIANTS]
    # The handcrafted orders compete too, so the search never loses to one that fits.
    for name in HANDCRAFTED:
        hand = build_schedule(name, pp=pp, microbatches=microbatches)
        candidates.append(Schedule(pp, 1, microbatches, LOOPED,
                                   [hand.compute_order(r) for r in range(pp)], name="zb-auto"))
    seen = set()
    for s in candidates:
        key = tuple(tuple(s.compute_order(r)) for r in range(pp))
        if key in seen:                  # variants often agree: simulate each order once
            continue
        seen.add(key)
        r = simulate(s.with_recv_lookahead(lookahead), costs, comm=comm)
        if any(p > lim * (1 + 1e-12) for p, lim in zip(r.peak_memory, limits)):
            continue
        key = (round(r.makespan, 12), max(r.peak_memory))
        if best is None or key < best[0]:
            best = (key, s)
    if best is None:
        raise ScheduleError(f"zb-auto: no variant fits under memory_limit {list(limits)}; raise it")
    s = best[1]
    if forward_only:
        return Schedule(pp, 1, microbatches, LOOPED,
                        [[a for a in s.compute_order(r) if a.op == F] for r in range(pp)],
                        name="zb-auto", forward_only=True)
    return s


@register("zb-auto", placement=LOOPED,
          constraints="vpp == 1; options costs=CostModel, memory_limit=bytes per rank "
                      "(pp * activation_bytes: ZB-1p, twice that: ZB-2p)",
          description="Zero Bubble's automatic schedule: greedy variants over F / I / W from a "
                      "cost model under a per-rank memory limit, best simulated step kept")
def zb_auto(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False, costs=None,
            memory_limit=None, comm: str = "async", lookahead: int = 0) -> Schedule:
    require_vpp("zb-auto", vpp, 1, " (one stage per rank, as ZB-1p / ZB-2p)")
    return zb_auto_schedule(pp, microbatches, costs, memory_limit, forward_only=forward_only,
                            comm=comm, lookahead=lookahead)
