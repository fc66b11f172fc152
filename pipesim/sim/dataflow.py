"""The walk of one rank over its lowered rows, and the ``async`` / ``blocking`` modes without
SimPy: a ready list over ranks.

:func:`walk` is the one place that says how a rank runs its rows (the SimPy engine drives the
same generator, :func:`pipesim.sim.engine._run`): on a local clock, a computation waits for the
message its row names (and an overlap's gate), a SEND occupies its directed link from when
both the data and the link are free (FIFO: a link has one sender, so its queue follows that
rank's order), a RECV only posts, and the sharding actions (ZeRO's UNSHARD / RESHARD /
REDUCE_GRAD, :mod:`pipesim.schedule.sharding`) run on the rank's own communication lane, one
at a time (`pipesim.plan.costs.CostModel`: an UNSHARD's computation waits for it). It yields the
message it needs when that message has not been sent yet, and is resumed once it has.

In the ``async`` and ``blocking`` modes nothing a rank computes depends on *when*, in simulated
time, another rank acts, only on the times it is sent. The step is then a dataflow problem,
solved by running each rank until it needs a message not yet sent, parking it there, and waking
it when the message is sent, in any order: no event heap, no SimPy events
(``tests/test_sim_engine.py`` compares the spans with the SimPy engine's on every builder).

The modes whose result depends on the order of events in time (``rendezvous``: a link serves
transfers in the order they become ready; shared cores: a computation's speed depends on what
runs beside it) drive :func:`walk` from SimPy, through its two hooks.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from ..plan.costs import CostModel
from ..schedule.op import CODE_RESHARD, CODE_UNSHARD, FIRST_COMM_CODE, FIRST_SHARD_CODE, Op
from ..schedule.program import Program

_RECV_F, _RECV_B = Op.RECV_F.code, Op.RECV_B.code


class Clocks:
    """What the ranks of one run share: every row's start and end, each message's arrival (-1
    until sent), the token of the rank parked on it, each directed link's next free time."""

    __slots__ = ("starts", "ends", "arrival", "waiter", "link_free", "durations", "link_time",
                 "shard_time", "shard_overlap")

    def __init__(self, program: Program, costs: CostModel) -> None:
        n = program.num_stages
        rows = program.num_rows
        self.starts = [0.0] * rows
        self.ends = [0.0] * rows
        self.arrival = [-1.0] * program.num_messages
        self.waiter: list = [None] * program.num_messages
        self.link_free = [0.0] * (program.pp * program.pp)
        times = costs.compute_times(n)
        self.durations = (times[Op.F], times[Op.B], times[Op.I], times[Op.W])   # by code
        self.link_time = [costs.transfer_time(x) for x in costs.stage_values("p2p_bytes", n)]
        # UNSHARD, RESHARD (free), REDUCE_GRAD per stage, by code - FIRST_SHARD_CODE
        self.shard_time = (costs.stage_values("unshard", n), [0.0] * n,
                           costs.stage_values("reduce_grad", n))
        self.shard_overlap = costs.overlap_sharding == 1.0


def walk(steps: Sequence[tuple], clocks: Clocks, wake: Callable[[object, float], None],
         factors: Sequence[float] | None, scale: dict[int, float] | None, blocking: bool,
         on_send: Callable | None = None, on_recv: Callable | None = None,
         shared_cpu: bool = False) -> Iterator:
    """Run one rank's ``steps`` (:meth:`Program.steps`); yields the message number it waits
    for, and resumes once that message's arrival is set.

    ``wake(token, arrival)`` is called when a message somebody is parked on (``waiter``) is
    sent. ``on_send(msg, row, link, seconds, t)`` / ``on_recv(msg, t)`` (rendezvous): a SEND
    only records its posting and the driver places the transfer once both sides posted.
    ``shared_cpu``: a computation yields ``(t, work)`` and is sent its end time back."""
    starts, ends, arrival, waiter = clocks.starts, clocks.ends, clocks.arrival, clocks.waiter
    link_free, durations, link_time = clocks.link_free, clocks.durations, clocks.link_time
    scaled = factors is not None or scale is not None
    t = 0.0
    lane = 0.0            # the rank's sharding lane is free from
    gathered = 0.0        # the last UNSHARD's end: the next computation waits for it
    began = 0.0           # the last computation's start: an overlapped UNSHARD prefetches from it
    for row, code, stage, wait, wait_row, gate, gate_row, sends in steps:
        if code >= 0:
            if code < FIRST_COMM_CODE:                   # F, B, I, W
                if wait >= 0 or gate >= 0:
                    # The wait for a posted receive happens here, in the compute that needs it
                    # (an overlap's forward part first waits for its backward part's input).
                    for need, at in ((gate, gate_row), (wait, wait_row)):
                        if need < 0:
                            continue
                        e = arrival[need]
                        if e < 0.0:
                            yield need
                            e = arrival[need]
                        starts[at] = t
                        if e > t:
                            t = e
                        ends[at] = t
                work = durations[code][stage]
                if scaled:
                    if factors is not None:
                        work *= factors[row]
                    if scale is not None and row in scale:
                        work *= scale[row]
                if gathered > t:
                    t = gathered
                starts[row] = began = t
                if shared_cpu:
                    t = yield (t, work)
                else:
                    t += work
                ends[row] = t
            elif code >= FIRST_SHARD_CODE:               # UNSHARD, RESHARD, REDUCE_GRAD
                if code == CODE_RESHARD:
                    starts[row] = ends[row] = t          # a release: no communication
                    continue
                s = began if code == CODE_UNSHARD and clocks.shard_overlap else t
                if s < lane:
                    s = lane
                lane = s + clocks.shard_time[code - FIRST_SHARD_CODE][stage]
                starts[row], ends[row] = s, lane
                if not clocks.shard_overlap:
                    t = lane                             # the rank waits for its collective
                elif code == CODE_UNSHARD:
                    gathered = lane
                continue
            else:                                        # RECV: post only
                starts[row] = ends[row] = t              # until the consumer waits
                if on_recv is not None:
                    on_recv(wait, t)
                continue
        for srow, msg, link, boundary in sends:          # SEND_F, SEND_B
            c = link_time[boundary]
            if on_send is not None:
                starts[srow] = ends[srow] = t            # until the transfer is placed
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
            w = waiter[msg]
            if w is not None:
                waiter[msg] = None
                wake(w, e)


def run_dataflow(program: Program, costs: CostModel, factors: Sequence[float] | None,
                 blocking: bool, together: bool = False, scale: dict[int, float] | None = None
                 ) -> tuple[list[float], list[float], list[list[int]]]:
    """Start and end time of every row (rank, row order), and each rank's compute rows
    (ascending). ``together``: an overlap's parts start together (the program's ``together``
    rows); ``scale``: per row, the factor that makes an overlap's parts take
    ``CostModel.overlap_time``. Raises RuntimeError if ranks are left waiting (a deadlock that
    ``Schedule.validate`` should have refused)."""
    pp = program.pp
    clocks = Clocks(program, costs)
    waiter = clocks.waiter
    ready: list[int] = []                               # ranks to resume

    def wake(rank: int, _arrival: float) -> None:
        ready.append(rank)

    processes = [walk(steps, clocks, wake, factors, scale, blocking)
                 for steps in program.steps(together)]
    done = [False] * pp
    ready.extend(range(pp - 1, -1, -1))                 # rank 0 first
    while ready:
        rank = ready.pop()
        msg = next(processes[rank], None)
        if msg is None:
            done[rank] = True
        else:
            waiter[msg] = rank
    if not all(done):
        stuck = [r for r in range(pp) if not done[r]]
        raise RuntimeError(f"simulation stopped with rank(s) {stuck} waiting on a receive; "
                           "validate() should have caught this deadlock")
    return clocks.starts, clocks.ends, program.compute_rows()
