"""The walk of the ranks over their lowered rows, and the ``async`` / ``blocking`` modes without
SimPy: one pass over every rank's steps in an order of the program's data flow.

:func:`walk` is the one place that says how a rank runs its rows (the SimPy engine drives the
same generator, :func:`pipesim.sim.engine._run`): on the rank's clock, a computation waits for
the message its row names (and an overlap's gate), a SEND occupies its directed link from when
both the data and the link are free (FIFO: a link has one sender, so its queue follows that
rank's order), a RECV only posts, and the sharding actions (ZeRO's UNSHARD / RESHARD /
REDUCE_GRAD, :mod:`pipesim.schedule.sharding`) run on the rank's own communication lane, one
at a time (`pipesim.plan.costs.CostModel`: an UNSHARD's computation waits for it; a stage made
of several units streams them with the computation they serve: the computation waits for the
first unit's gather and ends no sooner than its last unit's share after the gather ends, a
reduction starts once its backward made the first unit's gradients and ends no sooner than one
unit's reduction after that backward). It yields the message it needs when that message has not
been sent yet, and is resumed once it has.

In the ``async`` and ``blocking`` modes nothing a rank computes depends on *when*, in simulated
time, another rank acts, only on the times it is sent: a message's arrival is fixed by its
sender's steps before it (its link has no other sender). So any order of all the steps that
keeps each rank's steps in turn and each computation after the SEND of what it waits for gives
the same times, to the bit. :func:`dataflow_order` finds one once a program (kept with it,
:meth:`Program.derived`), by running the ranks as a ready list would, each until it needs a
message not yet sent; a run is then one walk over that order, which never waits: no parking
and waking of ranks (a rank waits about every other action in a 1F1B steady state), no event
heap, no SimPy events (``tests/test_sim_engine.py`` compares the spans with the SimPy engine's
on every builder). The plain case (no jitter, overlap scale, gated overlapped pairs, sharding
lane or blocking sends: every default simulation) runs as :func:`walk_plain`, walk's
statements for it in one loop.

The modes whose result depends on the order of events in time (``rendezvous``: a link serves
transfers in the order they become ready; shared cores: a computation's speed depends on what
runs beside it) drive :func:`walk` from SimPy, one walk per rank, through its two hooks.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import NamedTuple

from ..plan.costs import CostModel
from ..schedule.op import CODE_RESHARD, CODE_UNSHARD, FIRST_COMM_CODE, FIRST_SHARD_CODE, Op
from ..schedule.program import Program

# CostModel.compute_times' lists in code order (F, B, I, W), by their names' plain strings (a
# str-Enum member hashes through a Python-level __hash__)
_by_code = itemgetter(*(Op.of_code(code).value for code in range(FIRST_COMM_CODE)))

class CostTables(NamedTuple):
    """What :func:`walk` reads from the costs, per stage: each code's compute seconds (F, B, I,
    W), each boundary's transfer seconds, the sharding actions' seconds and one unit's share of
    them (UNSHARD, RESHARD, REDUCE_GRAD, by code - FIRST_SHARD_CODE), and the lane's switches.
    A pure function of (costs, stages): made once a CostModel (:meth:`CostModel.derived`)."""

    durations: tuple[tuple[float, ...], ...]
    link_time: tuple[float, ...]
    shard_time: tuple[tuple[float, ...], ...]
    shard_unit: tuple[tuple[float, ...], ...]
    shard_overlap: bool
    reduce_waits: bool
    streams: bool


def cost_tables(costs: CostModel, n: int, pp: int) -> CostTables:
    """The :class:`CostTables` of ``costs`` over ``n`` stages on ``pp`` ranks (read through
    ``costs.derived``); raises ValueError naming the first field that does not fit them
    (:meth:`CostModel.check_shape`), so the same costs are checked once a shape."""
    costs.check_shape(n, pp)
    overlap = costs.overlap_sharding == 1.0
    # units stream only when the lane overlaps the computations (blocking: the stage at once)
    units = [costs.stage_values(name, n) for name in ("unshard_units", "reduce_grad_units")]
    return CostTables(
        durations=tuple(tuple(x) for x in _by_code(costs.compute_times(n))),
        link_time=tuple(costs.transfer_time(x) for x in costs.stage_values("p2p_bytes", n)),
        shard_time=(tuple(costs.stage_values("unshard", n)), (0.0,) * n,
                    tuple(costs.stage_values("reduce_grad", n))),
        shard_unit=tuple(tuple(1.0 / u if overlap else 1.0 for u in x)
                         for x in (units[0], [1.0] * n, units[1])),
        shard_overlap=overlap,
        # the rank waits for its REDUCE_GRAD: blocking, or the end of each backward waits
        reduce_waits=not overlap or costs.overlap_reduce_grad == 0.0,
        streams=overlap and any(u > 1.0 for x in units for u in x))


class Clocks:
    """What the ranks of one run share: every row's start and end, each message's arrival (-1
    until sent), the token of the rank parked on it (``parking``: a SimPy run's; else None),
    each directed link's next free time, each rank's clock, and each rank's sharding lane (None
    without sharding actions or streamed units): when it is free, when the next computation may
    start (its UNSHARD's end, or its first unit's), when its last UNSHARD ends and the share of
    the computation after it (streamed units: the last unit's), and when its last computation
    began and how long it computed (an overlapped UNSHARD prefetches from there; a streamed
    REDUCE_GRAD starts inside it). The costs it reads are ``tables`` (:func:`cost_tables`)."""

    __slots__ = ("starts", "ends", "arrival", "waiter", "link_free", "clock", "tables",
                 "sharded", "lane", "gathered", "gathered_end", "gathered_tail", "began", "work")

    def __init__(self, program: Program, costs: CostModel, parking: bool = False) -> None:
        rows, msgs, pp = program.num_rows, program.num_messages, program.pp
        self.tables = tables = costs.derived(cost_tables, program.num_stages, pp)
        self.sharded = sharded = program.sharded     # the lane is used at all
        self.starts = [0.0] * rows
        self.ends = [0.0] * rows
        self.arrival = [-1.0] * msgs
        # a dataflow order never parks a rank: a list fewer to make a run
        self.waiter: list | None = [None] * msgs if parking else None
        self.link_free = [0.0] * (pp * pp)
        self.clock = [0.0] * pp
        if sharded or tables.streams:
            self.lane = [0.0] * pp
            self.gathered = [0.0] * pp
            self.gathered_end = [0.0] * pp
            self.gathered_tail = [0.0] * pp
            self.began = [0.0] * pp
            self.work = [0.0] * pp
        else:                           # no lane: walk reads none of these
            self.lane = self.gathered = self.gathered_end = self.gathered_tail = None
            self.began = self.work = None


def walk(steps: Iterable[tuple], clocks: Clocks,
         wake: Callable[[object, float], None] | None, factors: Sequence[float] | None,
         scale: dict[int, float] | None, blocking: bool, on_send: Callable | None = None,
         on_recv: Callable | None = None, shared_cpu: bool = False) -> Iterator:
    """Run ``steps`` (:meth:`Program.steps`' tuples, each with its rank in front: one tuple to
    unpack a step), each on its rank's clock (``clocks.clock``);
    yields the message number a step waits for when it has not been sent, and resumes once that
    message's arrival is set.

    ``wake(token, arrival)`` is called when a message somebody is parked on (``waiter``) is
    sent; None where nobody parks (a dataflow order: its clocks have no ``waiter``).
    ``on_send(msg, row, link, seconds, t)`` / ``on_recv(msg, t)`` (rendezvous): a SEND only
    records its posting and the driver places the transfer once both sides posted.
    ``shared_cpu``: a computation yields ``(t, work)`` and is sent its end time back."""
    starts, ends, arrival, waiter = clocks.starts, clocks.ends, clocks.arrival, clocks.waiter
    tables = clocks.tables
    link_free, durations, link_time = clocks.link_free, tables.durations, tables.link_time
    clock, gathered, began = clocks.clock, clocks.gathered, clocks.began
    streams, gathered_end, gathered_tail = tables.streams, clocks.gathered_end, clocks.gathered_tail
    scaled = factors is not None or scale is not None
    lane_used = clocks.sharded or streams          # else the lane's lists are None
    # a computation that only adds its time: no factor, no shared processor, no sharding lane
    plain = not (scaled or shared_cpu or lane_used)
    first_comm = FIRST_COMM_CODE
    for rank, row, code, stage, wait, wait_row, gate, gate_row, sends in steps:
        t = clock[rank]
        if code >= 0:
            if code < first_comm:                       # F, B, I, W
                # The wait for a posted receive happens here, in the compute that needs it (an
                # overlap's forward part first waits for its backward part's input, its gate).
                if gate >= 0:
                    e = arrival[gate]
                    if e < 0.0:
                        yield gate
                        e = arrival[gate]
                    starts[gate_row] = t
                    if e > t:
                        t = e
                    ends[gate_row] = t
                if wait >= 0:
                    e = arrival[wait]
                    if e < 0.0:
                        yield wait
                        e = arrival[wait]
                    starts[wait_row] = t
                    if e > t:
                        t = e
                    ends[wait_row] = t
                work = durations[code][stage]
                if plain:
                    starts[row] = t
                    t += work
                    ends[row] = t
                else:
                    if scaled:
                        if factors is not None:
                            work *= factors[row]
                        if scale is not None and row in scale:
                            work *= scale[row]
                    if lane_used:
                        if gathered[rank] > t:
                            t = gathered[rank]
                        began[rank] = t
                    starts[row] = t
                    if shared_cpu:
                        t = yield (t, work)
                    else:
                        t += work
                    if streams:             # its last unit computes after the gather ends
                        clocks.work[rank] = work
                        e = gathered_end[rank] + work * gathered_tail[rank]
                        if e > t:
                            t = e
                    ends[row] = t
            elif code >= FIRST_SHARD_CODE:              # UNSHARD, RESHARD, REDUCE_GRAD
                if code != CODE_RESHARD:                # a release: no communication
                    overlap = tables.shard_overlap
                    seconds = tables.shard_time[code - FIRST_SHARD_CODE][stage]
                    unit = tables.shard_unit[code - FIRST_SHARD_CODE][stage]
                    if code == CODE_UNSHARD:
                        s = began[rank] if overlap else t
                    elif unit < 1.0:            # streamed from its backward's first unit
                        s = began[rank] + clocks.work[rank] * unit
                    else:
                        s = t
                    lane = clocks.lane[rank]
                    if s < lane:
                        s = lane
                    lane = s + seconds
                    if code == CODE_UNSHARD:
                        if not overlap:
                            clock[rank] = lane          # the rank waits for its collective
                        elif unit < 1.0:            # its computation starts on the first unit
                            gathered[rank] = s + seconds * unit
                            gathered_end[rank] = lane
                            gathered_tail[rank] = unit
                        else:
                            gathered[rank] = lane
                            gathered_tail[rank] = 0.0
                    else:
                        if unit < 1.0:              # its last bucket after the backward
                            last = t + seconds * unit
                            if last > lane:
                                lane = last
                        if tables.reduce_waits:
                            clock[rank] = lane
                    clocks.lane[rank] = lane
                    starts[row], ends[row] = s, lane
                else:
                    starts[row] = ends[row] = t
                continue
            else:                                       # RECV: post only
                starts[row] = ends[row] = t             # until the consumer waits
                if on_recv is not None:
                    on_recv(wait, t)
                continue
        if not sends:
            clock[rank] = t
            continue
        for srow, msg, link, boundary in sends:         # SEND_F, SEND_B
            c = link_time[boundary]
            if on_send is not None:
                starts[srow] = ends[srow] = t           # until the transfer is placed
                on_send(msg, srow, link, c, t)
                continue
            s = link_free[link]
            if s < t:
                s = t
            e = s + c
            link_free[link] = e
            arrival[msg] = e
            starts[srow] = s
            ends[srow] = e
            if blocking:
                t = e
            if wake is not None:
                w = waiter[msg]
                if w is not None:
                    waiter[msg] = None
                    wake(w, e)
        clock[rank] = t


def walk_plain(order: Iterable[tuple], program: Program, tables: CostTables
               ) -> tuple[list[float], list[float]]:
    """:func:`walk`'s plain case over a dataflow order of ``program`` (every rank's steps, each
    after the SEND of what it waits for), in one loop on clocks of its own; returns every row's
    start and end. Plain: no jitter factors, overlap scale, overlapped pairs (no step has a
    gate: `gated`), sharding actions or streamed units (a computation only adds its time; a
    step from FIRST_COMM_CODE up is a RECV), sends that only occupy their link (not blocking,
    no rendezvous), and nobody parks. The same statements as `walk`'s for those steps (the
    tests compare the two on every builder), apart because every default simulation runs
    this: a generator's frame, a :class:`Clocks` and the other cases' branches were a tenth of
    a small run."""
    rows, pp = program.num_rows, program.pp
    starts, ends = [0.0] * rows, [0.0] * rows
    arrival = [-1.0] * program.num_messages           # as `Clocks` starts them
    link_free, clock = [0.0] * (pp * pp), [0.0] * pp
    durations, link_time = tables.durations, tables.link_time
    first_comm = FIRST_COMM_CODE
    for rank, row, code, stage, wait, wait_row, _gate, _gate_row, sends in order:
        t = clock[rank]
        if code >= first_comm:                          # RECV: post only
            starts[row] = ends[row] = t                 # until the consumer waits
            continue
        if code >= 0:                                   # F, B, I, W
            if wait >= 0:
                e = arrival[wait]
                if e < 0.0:
                    raise AssertionError(f"the dataflow order runs a step before message "
                                         f"{wait} is sent")
                starts[wait_row] = t
                if e > t:
                    t = e
                ends[wait_row] = t
            starts[row] = t
            t += durations[code][stage]
            ends[row] = t
        for srow, msg, link, boundary in sends:         # SEND_F, SEND_B
            s = link_free[link]
            if s < t:
                s = t
            e = s + link_time[boundary]
            link_free[link] = e
            arrival[msg] = e
            starts[srow] = s
            ends[srow] = e
        clock[rank] = t
    return starts, ends


def gated(program: Program, together: bool) -> bool:
    """Whether some computation of ``program`` waits for a gate (an overlapped pair's forward
    part waits for its backward part's input): `walk_plain` leaves those to `walk`."""
    return any(step[6] >= 0 for steps in program.steps(together) for step in steps
               if 0 <= step[2] < FIRST_COMM_CODE)


def dataflow_order(program: Program, together: bool) -> tuple[tuple, ...]:
    """Every rank's steps (:meth:`Program.steps`, each ``(rank, *step)``) in one order that
    keeps each rank's steps in turn and puts each computation after the SEND of every message
    it waits for. Found by running the ranks, lowest first, each until it needs a message not
    yet sent (it is run again once that message is sent). Raises RuntimeError naming the ranks
    left waiting (a deadlock that ``Schedule.validate`` refuses)."""
    per_rank = program.steps(together)
    pp = program.pp
    sent = bytearray(program.num_messages)
    parked: dict[int, int] = {}                         # message -> the rank waiting for it
    done = [0] * pp                                     # steps of each rank in the order so far
    ready = list(range(pp - 1, -1, -1))                 # ranks to run, rank 0 first
    order: list[tuple] = []
    append = order.append
    first_comm = FIRST_COMM_CODE
    while ready:
        rank = ready.pop()
        steps = per_rank[rank]
        count = len(steps)
        i = done[rank]
        while i < count:
            step = steps[i]
            if 0 <= step[2] < first_comm:               # a computation: its gate, then its input
                need = step[6]
                if need < 0 or sent[need]:
                    need = step[4]
                if need >= 0 and not sent[need]:
                    parked[need] = rank
                    break
            append(step)
            sends = step[8]
            if sends:
                for send in sends:
                    msg = send[1]
                    sent[msg] = 1
                    if parked:
                        waiting = parked.pop(msg, None)
                        if waiting is not None:
                            ready.append(waiting)
            i += 1
        done[rank] = i
    stuck = [r for r in range(pp) if done[r] < len(per_rank[r])]
    if stuck:
        raise RuntimeError(f"simulation stopped with rank(s) {stuck} waiting on a receive; "
                           "validate() should have caught this deadlock")
    return tuple(order)


def dataflow_spans(program: Program, costs: CostModel, factors: Sequence[float] | None,
                   blocking: bool, together: bool = False, scale: dict[int, float] | None = None
                   ) -> tuple[list[float], list[float]]:
    """Start and end time of every row (rank, row order). ``together``: an overlap's parts
    start together (the program's ``together`` rows); ``scale``: per row, the factor that makes
    an overlap's parts take ``CostModel.overlap_time``. Raises RuntimeError if ranks are left
    waiting (a deadlock that ``Schedule.validate`` should have refused)."""
    tables = costs.derived(cost_tables, program.num_stages, program.pp)  # checks costs first
    order = program.derived(dataflow_order, together)
    if (factors is None and scale is None and not blocking and not program.sharded
            and not tables.streams and not program.derived(gated, together)):
        return walk_plain(order, program, tables)
    clocks = Clocks(program, costs)
    for msg in walk(order, clocks, None, factors, scale, blocking):
        raise AssertionError(f"the dataflow order runs a step before message {msg} is sent")
    return clocks.starts, clocks.ends

