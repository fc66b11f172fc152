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
* at vpp 1, the paper's own sweep over the microbatches (:mod:`pipesim.zb_auto.sweep_order`:
  warm-up forwards counted from when the first backward's gradient can arrive, then one F and
  one I per stage per microbatch with W passes filling the gaps), each of its variants: the
  time-ordered list scheduling above never runs the long warm-up a 2p limit allows when W is
  cheaper than F, and so stopped at ZB-H2's order (7% bubble on the paper's 6.2B-28.3B
  costs, where the paper's ZB-2p column has under 1%);
* the handcrafted schedules of the same vpp and placement compete as well (1F1B, ZB-H1, ZB-H2;
  at vpp 2 interleaved, ZB-V, V-Half, V-Min, DualPipeV), so the result is never predicted
  slower than one of them that fits the limit; and so does each one's F / I order (its B split
  into I and W) with the heuristic placing the W passes (from 1F1B this finds ZB-H1's kind of
  order, from interleaved a zero-bubble interleaved one).

Memory is counted as the simulator counts it (:mod:`pipesim.sim.memory`): static bytes, plus a
stage's ``activation_bytes`` from the start of each F, minus (1 - weight_grad_fraction) of it at
the end of I and the rest at the end of W, plus the received gradient's buffer while its I runs.
``memory_limit = pp * activation_bytes`` is ZB-1p's budget, twice that ZB-2p's. The candidates
are simulated with the same cost model (and the ``comm`` mode, receive ``lookahead`` and shared
``cores`` the schedule will run with: options) and only those whose peak fits are kept, so the
returned schedule's simulated peak never exceeds the limit. Under ZeRO-2/3 (``sharding=``) each
candidate is simulated lowered with it, as it will run: its UNSHARD / REDUCE_GRAD priced by the
costs' ``unshard`` / ``reduce_grad`` on the rank's communication lane, so an order is ranked
with the gathers and reductions it makes the rank wait for (the order returned is the plain
one: whoever runs it lowers it, `Schedule.with_sharding`).

One chunk per rank (vpp == 1, looped placement) is the paper's setting. With vpp == 2 (costs for
2 * pp stages) the same list scheduling runs over each rank's two stages, for the looped and
the V placement (``placement=`` picks one), a rank choosing among its ready stages by variant
(the deepest first, or the first arrived) and starting an early-chunk forward only when the
limit leaves room for that microbatch's later chunks on the rank (else it could fill its memory
with activations it cannot move on).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from itertools import product

from ..errors import ScheduleError
from ..schedule.action import B, F, I, W, Action
from ..schedule.placement import LOOPED, PLACEMENTS, VSHAPE, make_placement
from ..schedule.registry import build_schedule, register
from ..schedule.schedule import Schedule
from ..schedule.sharding import Sharding
from ..units import format_bytes
from .sweep_order import SWEEP_VARIANTS, SweepStuck, sweep_order


VARIANTS = tuple(product((True, False), ("fit", "eager"), ("none", "1f1b", "zb-2p"),
                         ("deep", "early")))
HANDCRAFTED = {1: ("1f1b", "zb-h1", "zb-h2"),
               2: ("interleaved", "zbv", "v-half", "v-min", "dualpipev")}


def handcrafted_origin(schedule: Schedule) -> str | None:
    """The handcrafted schedule whose order (placement and every rank's computations)
    ``schedule`` is, if any: what a zb-auto search kept when none of its own orders won."""
    for name in HANDCRAFTED.get(schedule.vpp, ()):
        try:
            hand = build_schedule(name, pp=schedule.pp, vpp=schedule.vpp,
                                  microbatches=schedule.num_microbatches)
        except ScheduleError:                       # its constraints exclude (pp, m)
            continue
        if hand.placement == schedule.placement and all(
                hand.compute_order(r) == schedule.compute_order(r) for r in range(schedule.pp)):
            return name
    return None


class StuckError(ScheduleError):
    """A variant of the heuristic found no rank able to move under the limit (others may)."""


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


def _key(s: Schedule) -> tuple:
    return (s.placement, tuple(tuple(s.compute_order(r)) for r in range(s.pp)))


def _placements(pp: int, vpp: int, placement: str | None) -> list[str]:
    allowed = [LOOPED, VSHAPE] if vpp == 2 and pp > 1 else [LOOPED]
    if placement is None:
        return allowed
    if placement not in PLACEMENTS:
        raise ScheduleError(f"zb-auto: placement must be one of {', '.join(PLACEMENTS)} or None "
                            f"(search every placement vpp allows), got {placement!r}")
    if placement not in allowed:
        raise ScheduleError(f"zb-auto: placement {placement!r} needs vpp == 2, got vpp = {vpp}")
    return [placement]


def greedy_order(pp: int, m: int, costs, limits: Sequence[float], prefer_i: bool, fill: str,
                 cap: str, chunk: str = "deep", vpp: int = 1,
                 placement: str = LOOPED,
                 follow: Sequence[Sequence[Action]] | None = None) -> list[list[Action]]:
    """One variant of the heuristic: per rank, the F / I / W order it schedules.

    ``chunk`` (vpp > 1): among a rank's stages whose forward is ready, run the deepest
    ("deep": microbatches reach the last stage, and their backward, sooner) or the one whose
    input came first ("early"). ``follow``: per rank, an F / I order to keep (a handcrafted
    schedule's, its B read as I): only where each W goes is searched, as ZB-H1 is 1F1B with
    its W moved into the bubbles. Raises StuckError when the variant gets stuck under the
    limit (or ``follow`` takes a stage's microbatches out of order)."""
    n = pp * vpp
    where = make_placement(placement, pp, vpp)
    stages_of = [[s for s in range(n) if where[s] == r] for r in range(pp)]
    times = costs.compute_times(n)
    tf, ti, tw = times[F], times[I], times[W]
    nbytes = costs.stage_values("p2p_bytes", n)
    act = costs.stage_values("activation_bytes", n)
    keep = [f * a for f, a in zip(costs.stage_values("weight_grad_fraction", n), act)]
    static_stage = costs.stage_values("stage_static_bytes", n)
    mem = list(costs.rank_static_bytes(pp))
    for s in range(n):
        mem[where[s]] += static_stage[s]
    remote = [s < n - 1 and where[s] != where[s + 1] for s in range(n)]   # s -> s + 1 a transfer
    down = [costs.transfer_time(nbytes[s]) if remote[s] else 0.0 for s in range(n)]
    buf = [nbytes[s] if remote[s] else 0.0 for s in range(n)]           # gradient buffer at I
    caps = {"none": [m * vpp] * pp, "1f1b": [vpp * (pp - r) for r in range(pp)],
            "zb-2p": [vpp * (2 * (pp - r) - 1) for r in range(pp)]}[cap]
    # Room an F of stage s leaves for one microbatch to go on through the rank's deeper stages,
    # so that a rank never fills its memory with early-chunk activations it cannot move on.
    # (The cap on held stage-microbatches keeps the same room.)
    deeper = [[q for q in stages_of[where[s]] if q > s] for s in range(n)]
    reserve = [sum(act[q] for q in deeper[s]) for s in range(n)]
    # what an F of stage s needs beyond its activations, and the stages after it on its rank
    room = [max(buf[s], reserve[s]) for s in range(n)]
    after = [len(deeper[s]) for s in range(n)]
    deepest_first = chunk == "deep"
    for r in range(pp):
        need = max(act[s] + buf[s] for s in stages_of[r])
        if mem[r] + need > limits[r]:
            raise ScheduleError(
                f"zb-auto: memory_limit {format_bytes(limits[r])} on rank {r} is below what one "
                f"microbatch needs there ({_size(mem[r])} static + "
                f"{_size(max(act[s] for s in stages_of[r]))} activations + "
                f"{_size(max(buf[s] for s in stages_of[r]))} gradient buffer)")
    nf, ni, nw = [0] * n, [0] * n, [0] * n
    f_end = [[None] * m for _ in range(n)]
    i_end = [[None] * m for _ in range(n)]
    held = [0] * pp                       # stage-microbatches between their F and their W
    pending_w: list[list[int]] = [[] for _ in range(pp)]    # stages, in the order their I ran
    free = [0.0] * pp
    # The rank to move next is the live, awake one with the least (free, rank): a heap of
    # (free, rank) entries, one pushed whenever a rank's free time changes or it wakes (an
    # entry is current while its time is the rank's and the rank live and awake), so a step
    # costs log pp, not a pass over every rank (at pp 32, m 256 that pass was most of it).
    queue = [(0.0, r) for r in range(pp)]
    blocked: set[int] = set()             # ranks waiting on what is not scheduled yet
    # What a rank can start depends on its own state and on what the ranks holding its stages'
    # neighbours (s - 1, s + 1) ran: a blocked rank is woken by a run there or its own, not by
    # every run (it would look again and block again: most of the steps at pp 16).
    wakes: list[set[int]] = [{r} for r in range(pp)]
    for s in range(n):
        for t in (s - 1, s + 1):
            if 0 <= t < n:
                wakes[where[t]].add(where[s])
    orders: list[list[Action]] = [[] for _ in range(pp)]
    # The transfers of each channel (kind, sender, receiver), in the order they are sent: the
    # receiver takes them in that order (pipeexec's channels, NCCL's matching), so a stage's
    # next F or I waits while an earlier transfer from that peer is not consumed.
    sent: dict[tuple[str, int, int], deque[tuple[int, int]]] = {}
    if follow is not None:
        follow = [[Action(I if a.op == B else a.op, a.stage, a.microbatch) for a in order
                   if a.op != W] for order in follow]
    pos = [0] * pp                       # next action of each rank's followed order
    w_left = [m * len(stages_of[r]) for r in range(pp)]    # W passes each rank has still to run

    def in_turn(s: int, op: str) -> bool:
        if op == F:
            src, k = s - 1, nf[s]
        else:
            src, k = s + 1, ni[s]
        if not 0 <= src < n or not remote[min(s, src)]:
            return True                  # the first or last stage, or a hand-over on the rank
        q = sent.get((op, where[src], where[s]))
        return bool(q) and q[0] == (s, k)

    def ready(s: int, op: str) -> float | None:
        """When the input of stage s's next ``op`` arrives; None while not yet known."""
        if op == F:
            if s == 0:
                return 0.0
            t = f_end[s - 1][nf[s]]
            return None if t is None else t + down[s - 1]
        if s == n - 1:
            return f_end[s][ni[s]]
        t = i_end[s + 1][ni[s]]
        return None if t is None else t + down[s]

    def run(r: int, op: str, s: int, start: float) -> None:
        if op in (F, I):
            src, dst = (s - 1, s + 1) if op == F else (s + 1, s - 1)
            if 0 <= src < n and remote[min(s, src)]:
                sent[(op, where[src], r)].popleft()              # its input, taken in turn
            if 0 <= dst < n and remote[min(s, dst)]:
                k = nf[s] if op == F else ni[s]
                sent.setdefault((op, r, where[dst]), deque()).append((dst, k))
        if op == F:
            end, k = start + tf[s], nf[s]
            f_end[s][k] = end
            nf[s] += 1
            mem[r] += act[s]
            held[r] += 1
        elif op == I:
            end, k = start + ti[s], ni[s]
            i_end[s][k] = end
            ni[s] += 1
            mem[r] -= act[s] - keep[s]
            pending_w[r].append(s)
        else:
            end, k = start + tw[s], nw[s]
            nw[s] += 1
            w_left[r] -= 1
            mem[r] -= keep[s]
            held[r] -= 1
        free[r] = end
        heapq.heappush(queue, (end, r))
        orders[r].append(Action(op, s, k))
        if op != W and follow is not None:
            pos[r] += 1
        for q in wakes[r]:
            if q in blocked:
                blocked.discard(q)
                heapq.heappush(queue, (free[q], q))

    def run_w(r: int) -> None:
        run(r, W, pending_w[r].pop(0), free[r])

    while True:
        while queue and (not w_left[queue[0][1]] or queue[0][1] in blocked
                         or queue[0][0] != free[queue[0][1]]):
            heapq.heappop(queue)          # a rank done, asleep, or moved on since
        if not queue:
            if not any(w_left):
                break
            # Every rank waits on something not scheduled yet: the earliest one with a W runs it.
            r = min((r for r in range(pp) if w_left[r] and pending_w[r]),
                    key=lambda q: (free[q], q), default=None)
            if r is None:
                raise StuckError(f"zb-auto: no rank can move under memory_limit {list(limits)}; "
                                 "raise the limit")
            run_w(r)
            continue
        e, r = heapq.heappop(queue)      # the least free time; ties: the lowest rank
        fs, is_ = [], []                 # (ready time, preference, stage) of each candidate
        if follow is None:
            more_f = None                # whether a stage has an F left: asked below if need be
            allowed_f = False            # an F that the cap and the memory limit let start
            for s in stages_of[r]:
                if (nf[s] < m and held[r] + after[s] < caps[r]
                        and mem[r] + act[s] + room[s] <= limits[r]):
                    allowed_f = True
                    t = ready(s, F)
                    if t is not None and in_turn(s, F):
                        fs.append((t, -s if deepest_first else t, s))
                if ni[s] < nf[s]:
                    t = ready(s, I)
                    if t is not None and in_turn(s, I):
                        is_.append((t, s))
        else:
            nxt_op = follow[r][pos[r]] if pos[r] < len(follow[r]) else None
            more_f = allowed_f = nxt_op is not None and nxt_op.op == F
            if nxt_op is not None:
                s = nxt_op.stage
                if nxt_op.microbatch != (nf[s] if nxt_op.op == F else ni[s]):
                    raise StuckError(f"zb-auto: the followed order runs stage {s}'s "
                                     f"microbatches out of order ({nxt_op})")
                if nxt_op.op == F:
                    allowed_f = mem[r] + act[s] + buf[s] <= limits[r]
                    t = ready(s, F) if allowed_f else None
                    if t is not None and in_turn(s, F):
                        fs.append((t, t, s))
                elif ni[s] < nf[s]:
                    t = ready(s, I)
                    if t is not None and in_turn(s, I):
                        is_.append((t, s))
        f_now = [c for c in fs if c[0] <= e]
        i_now = [c for c in is_ if c[0] <= e]
        f_pick = min((c[1], c[2]) for c in f_now)[1] if f_now else None
        i_pick = min(i_now)[1] if i_now else None
        if i_pick is not None and (prefer_i or f_pick is None):
            run(r, I, i_pick, e)
        elif f_pick is not None:
            run(r, F, f_pick, e)
        else:
            known = [c[0] for c in fs] + [c[0] for c in is_]
            nxt = min(known) if known else None
            if more_f is None:
                more_f = any(nf[s] < m for s in stages_of[r])
            if pending_w[r] and (fill == "eager"
                                 or (nxt is not None and e + tw[pending_w[r][0]] <= nxt)
                                 or (more_f and not allowed_f)):
                run_w(r)
            elif nxt is not None:
                free[r] = nxt
                heapq.heappush(queue, (nxt, r))
            else:
                blocked.add(r)
    return orders


STEP_TIE = 1e-12   # relative: steps this close are equal (sums in another order differ so)


def _pick(ranked: list[tuple]) -> tuple:
    """The least step; among steps equal to it (within float noise: the last rank's critical
    path often bounds them all) the paper's measure, the largest idle share of a rank's own span
    (``bubble_rate``: what a rank loses when steps follow each other), then the lower peak."""
    least = min(c[0] for c in ranked)
    tied = [c for c in ranked if c[0] <= least * (1 + STEP_TIE)]
    return min(tied, key=lambda c: (c[1], c[2]))


def fastest_handcrafted(pp: int, microbatches: int, costs, memory_limit=None, *, vpp: int = 1,
                        placement: str | None = None, comm: str = "async", lookahead: int = 0,
                        cores: float | None = None, sharding: Sharding | None = None
                        ) -> tuple[str, float] | None:
    """The hand-made schedule of this vpp (and placement) that zb-auto's ``margin`` is
    measured against: the fastest one whose simulated peak fits ``memory_limit``, simulated as
    the search simulates (lowered with ``sharding``); (name, step), or None when none fits."""
    from ..sim.engine import simulate

    limits = _limits(memory_limit, pp)
    kinds = _placements(pp, vpp, placement)
    best = None
    for name in HANDCRAFTED.get(vpp, ()):
        try:
            hand = build_schedule(name, pp=pp, vpp=vpp, microbatches=microbatches,
                                  recv_lookahead=lookahead)
        except ScheduleError:
            continue
        if hand.placement_kind not in kinds:
            continue
        r = simulate(hand.with_sharding(sharding), costs, comm=comm, cores=cores)
        if any(p > lim * (1 + 1e-12) for p, lim in zip(r.peak_memory, limits)):
            continue
        if best is None or r.makespan < best[1]:
            best = (name, r.makespan)
    return best


def _sweep_candidates(pp: int, m: int, costs, limits: Sequence[float]) -> list[Schedule]:
    """The paper's own sweep (:mod:`pipesim.zb_auto.sweep_order`), each of its variants, at one
    stage per rank: the orders that reach its ZB-2p column when W is cheaper than F."""
    times = costs.compute_times(pp)
    nbytes = costs.stage_values("p2p_bytes", pp)
    comm = [costs.transfer_time(nbytes[s]) for s in range(pp)]
    act = costs.stage_values("activation_bytes", pp)
    keep = [f * a for f, a in zip(costs.stage_values("weight_grad_fraction", pp), act)]
    static = [r + s for r, s in zip(costs.rank_static_bytes(pp),
                                    costs.stage_values("stage_static_bytes", pp))]
    out = []
    for before, prioritize, greedy in SWEEP_VARIANTS:
        try:
            orders = sweep_order(pp, m, times[F], times[I], times[W], comm, act, keep, static,
                                 limits, bubble_before_first_i=before, prioritize_i=prioritize,
                                 greedy_fill=greedy)
            candidate = Schedule(pp, 1, m, LOOPED, orders, name="zb-auto").validate()
        except ScheduleError:               # stuck, or (at a tight limit) an I before its F
            continue
        out.append(candidate)
    return out


def zb_auto_schedule(pp: int, microbatches: int, costs=None, memory_limit=None, *,
                     forward_only: bool = False, comm: str = "async", lookahead: int = 0,
                     vpp: int = 1, placement: str | None = None,
                     cores: float | None = None, margin: float = 0.0,
                     tail: Sequence[float] | None = None,
                     sharding: Sharding | None = None) -> Schedule:
    """The best of the heuristic's variants and the handcrafted schedules of the same vpp (see
    the module docstring), each simulated as the schedule will run: with ``comm`` (a
    `pipesim.simulate` mode), its receives posted ``lookahead`` computations early, and, where
    the ranks share ``cores`` processors, processor sharing (`pipesim.simulate`'s ``cores``).

    ``margin``: keep the fastest handcrafted order that fits unless a searched one is simulated
    faster by more than this fraction of its step (e.g. the accuracy of the costs' predictions:
    a gain inside it is not one to trust).

    ``tail`` (one per rank, seconds): what each rank does after its last action (its exposed
    data-parallel reduction and optimizer step, as a plan derives them): the step a candidate is
    ranked by is then the latest ``rank_end + tail``, not the pipeline's makespan alone.

    ``sharding`` (ZeRO-2/3's, `pipesim.schedule.sharding.Sharding`): each candidate is simulated
    lowered with it, its UNSHARD / REDUCE_GRAD priced by ``costs``; the returned order is the
    plain one (lower it to run or simulate it as ranked)."""
    from ..plan.costs import CostModel
    from ..sim.engine import simulate

    costs = CostModel() if costs is None else costs
    if not isinstance(costs, CostModel):
        raise ScheduleError(f"zb-auto: costs must be a pipesim.CostModel, got {type(costs).__name__}")
    n = pp * vpp
    try:
        costs.check_shape(n, pp)
    except ValueError as exc:
        raise ScheduleError(f"zb-auto: {exc} (pp * vpp = {n} stages)") from None
    limits = _limits(memory_limit, pp)
    kinds = _placements(pp, vpp, placement)
    if tail is None:
        tail = [0.0] * pp
    elif (isinstance(tail, (str, bytes)) or not isinstance(tail, Sequence) or len(tail) != pp
          or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
                     for x in tail)):
        raise ScheduleError(f"zb-auto: tail must be one time >= 0 per rank (pp = {pp}), got "
                            f"{tail!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise ScheduleError(f"zb-auto: margin must be a fraction >= 0 (0.05: 5%), got {margin!r}")
    if sharding is not None and not isinstance(sharding, Sharding):
        raise ScheduleError(f"zb-auto: sharding must be a pipesim.schedule.sharding.Sharding or "
                            f"None, got {type(sharding).__name__}")
    candidates, stuck, handcrafted = [], None, set()
    for kind in kinds:
        for prefer_i, fill, cap, chunk in VARIANTS:
            if vpp == 1 and chunk != "deep":
                continue                           # one stage per rank: nothing to choose
            try:
                orders = greedy_order(pp, microbatches, costs, limits, prefer_i, fill, cap,
                                      chunk, vpp, kind)
            except StuckError as exc:
                stuck = exc                         # this variant got stuck: the others compete
                continue
            candidates.append(Schedule(pp, vpp, microbatches, kind, orders, name="zb-auto"))
    if vpp == 1 and LOOPED in kinds:
        candidates += _sweep_candidates(pp, microbatches, costs, limits)
    # The handcrafted orders compete too, so the search never loses to one that fits; and each
    # one's F / I order with its W placed by the heuristic (B split into I and W).
    for name in HANDCRAFTED.get(vpp, ()):
        try:
            hand = build_schedule(name, pp=pp, vpp=vpp, microbatches=microbatches)
        except ScheduleError:                       # its constraints exclude (pp, m)
            continue
        kind = hand.placement_kind
        if kind not in kinds:
            continue
        orders = [hand.compute_order(r) for r in range(pp)]
        as_is = Schedule(pp, vpp, microbatches, kind, orders, name="zb-auto")
        handcrafted.add(_key(as_is))
        candidates.append(as_is)
        if any(a.op not in (F, B, I, W) for o in orders for a in o):
            continue                                # overlapped pairs: kept as they are
        for fill in ("fit", "eager"):
            try:
                follow = greedy_order(pp, microbatches, costs, limits, True, fill, "none",
                                      "deep", vpp, kind, follow=orders)
            except StuckError as exc:
                stuck = exc
                continue
            candidates.append(Schedule(pp, vpp, microbatches, kind, follow, name="zb-auto"))
    ranked, seen = [], set()              # (step, bubble rate, peak, is hand-made, schedule)
    for s in candidates:
        key = _key(s)
        if key in seen:                  # variants often agree: simulate each order once
            continue
        seen.add(key)
        r = simulate(s.with_sharding(sharding).with_recv_lookahead(lookahead), costs, comm=comm,
                     cores=cores)
        if any(p > lim * (1 + 1e-12) for p, lim in zip(r.peak_memory, limits)):
            continue
        step = max(end + extra for end, extra in zip(r.rank_end, tail)) if any(tail) \
            else r.makespan
        ranked.append((step, r.bubble_rate, max(r.peak_memory), key in handcrafted, s))
    if not ranked:
        raise ScheduleError(f"zb-auto: no variant fits under memory_limit {list(limits)}; raise it"
                            + (f" (last variant stuck: {stuck})" if stuck else ""))
    best = _pick(ranked)
    hands = [c for c in ranked if c[3]]
    if margin > 0 and hands:
        best_hand = _pick(hands)
        if best_hand[0] <= best[0] * (1 + margin):
            best = best_hand             # the searched gain is inside the margin
    s = best[4]
    if forward_only:
        return Schedule(pp, vpp, microbatches, s.placement,
                        [[a for a in s.compute_order(r) if a.op == F] for r in range(pp)],
                        name="zb-auto", forward_only=True)
    return s


@register("zb-auto", placement=LOOPED,
          constraints="vpp == 1 (looped), or vpp == 2 (looped or V, the best of both unless "
                      "placement= says); options costs=CostModel of pp * vpp stages, "
                      "memory_limit=bytes per rank (pp * activation_bytes: ZB-1p, twice that: "
                      "ZB-2p), cores= when the ranks share that many processors, "
                      "margin= what a searched order must gain over the handcrafted ones, "
                      "tail= each rank's time after its last action, sharding= ZeRO-2/3's "
                      "Sharding (candidates simulated with its actions)",
          description="Zero Bubble's automatic schedule: greedy variants over F / I / W from a "
                      "cost model under a per-rank memory limit, with the handcrafted schedules "
                      "of the same vpp; best simulated step kept")
def zb_auto(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False, costs=None,
            memory_limit=None, comm: str = "async", lookahead: int = 0,
            placement: str | None = None, cores: float | None = None,
            margin: float = 0.0, tail: Sequence[float] | None = None,
            sharding: Sharding | None = None) -> Schedule:
    if vpp not in (1, 2):
        raise ScheduleError(f"zb-auto needs vpp == 1 or 2 (one or two stages per rank), got "
                            f"vpp = {vpp}")
    return zb_auto_schedule(pp, microbatches, costs, memory_limit, forward_only=forward_only,
                            comm=comm, lookahead=lookahead, vpp=vpp, placement=placement,
                            cores=cores, margin=margin, tail=tail, sharding=sharding)


def _size(nbytes: float) -> str:
    """Bytes for a message: ``9.54 MiB``; a small count (unit costs) as the bare number."""
    return format_bytes(nbytes).removesuffix(" bytes")
