"""The ``async`` and ``blocking`` communication modes without SimPy: a ready list over ranks.

In these modes nothing a rank computes depends on *when*, in simulated time, another rank acts,
only on the times it is sent: a directed link has one sender, so its FIFO follows that rank's
own order, and a message's arrival is fixed by its sender's clock. The step is then a dataflow
problem, solved by running each rank on its local clock until it needs a message not yet sent,
parking it there, and waking it when the message is sent, in any order: no event heap, no
SimPy events. It produces exactly the spans of :func:`pipesim.engine._run` (same arithmetic, in
the same order per rank; ``tests/test_sim_engine.py`` compares the two on every builder).

The modes whose result depends on the order of events in time (``rendezvous``: a link serves
transfers in the order they become ready; shared cores: a computation's speed depends on what
runs beside it) stay on the SimPy engine.
"""
from __future__ import annotations

from collections.abc import Iterator

from .costs import CostModel
from .schedule.action import B, F, I, RECV_B, RECV_F, SEND_F, W
from .schedule.schedule import Schedule


def run_dataflow(schedule: Schedule, actions: list[list], costs: CostModel,
                 factors: list[float] | None, blocking: bool,
                 overlaps: tuple | None = None
                 ) -> tuple[list[float], list[float], list[list[int]]]:
    """Start and end time of every row (rank, action order), and each rank's compute rows
    (ascending); arguments as ``engine._run``.

    Messages are numbered ``(direction * n + receiving stage) * m + microbatch``; the directed
    link ``a -> b`` is ``a * pp + b``. Raises RuntimeError if ranks are left waiting (a deadlock
    that ``Schedule.validate`` should have refused).
    """
    pp, n, m = schedule.pp, schedule.num_stages, schedule.num_microbatches
    placement = schedule.placement
    times = costs.compute_times(n)
    nbytes = costs.stage_values("p2p_bytes", n)
    fwd_time = [costs.transfer_time(x) for x in nbytes]          # out of stage s, forward
    bwd_time = [0.0] + fwd_time[:-1]                              # out of stage s, backward
    durations = {op: times[op] for op in (F, B, I, W)}
    rows = sum(len(a) for a in actions)
    starts = [0.0] * rows
    ends = [0.0] * rows
    msgs = 2 * n * m
    arrival = [-1.0] * msgs
    waiter = [-1] * msgs                            # msg -> rank parked on it
    recv_row = [-1] * msgs                          # msg -> row of its posted RECV
    link_free = [0.0] * (pp * pp)
    ready: list[int] = []                           # ranks to resume
    compute: list[list[int]] = [[] for _ in range(pp)]
    gate, scale = (overlaps[1], overlaps[2]) if overlaps is not None else (None, None)
    scaled = factors is not None or scale is not None

    def rank_process(rank: int, acts: list, first: int) -> Iterator[int]:
        """Yields the message it waits for; resumed once that message has been sent."""
        t = 0.0
        base = rank * pp
        computed = compute[rank].append
        duration = durations.get
        for row, (op, stage, mb) in enumerate(acts, first):
            d = duration(op)
            if d is not None:                       # F, B, I, W
                if gate is not None and row in gate:
                    _, bs, bmb = gate[row]
                    msg = (n + bs) * m + bmb
                    r = recv_row[msg]
                    if r >= 0:
                        if arrival[msg] < 0.0:
                            yield msg
                        e = arrival[msg]
                        starts[r] = t
                        if e > t:
                            t = e
                        ends[r] = t
                        recv_row[msg] = -1
                if op != W:
                    msg = stage * m + mb if op == F else (n + stage) * m + mb
                    r = recv_row[msg]
                    if r >= 0:
                        if arrival[msg] < 0.0:
                            yield msg
                        e = arrival[msg]
                        starts[r] = t
                        if e > t:
                            t = e
                        ends[r] = t
                work = d[stage]
                if scaled:
                    if factors is not None:
                        work *= factors[row]
                    if scale is not None and row in scale:
                        work *= scale[row]
                starts[row] = t
                t += work
                ends[row] = t
                computed(row)
            elif op == RECV_F or op == RECV_B:      # post only
                msg = stage * m + mb if op == RECV_F else (n + stage) * m + mb
                recv_row[msg] = row
                starts[row] = ends[row] = t         # until the consumer waits
            else:                                   # SEND_F, SEND_B
                if op == SEND_F:
                    msg = (stage + 1) * m + mb
                    link = base + placement[stage + 1]
                    c = fwd_time[stage]
                else:
                    msg = (n + stage - 1) * m + mb
                    link = base + placement[stage - 1]
                    c = bwd_time[stage]
                s = link_free[link]
                if s < t:
                    s = t
                e = s + c
                link_free[link] = e
                arrival[msg] = e
                starts[row] = s
                ends[row] = e
                if blocking:
                    t = e
                w = waiter[msg]
                if w >= 0:
                    ready.append(w)
                    waiter[msg] = -1

    processes = []
    row = 0
    for rank in range(pp):
        processes.append(rank_process(rank, actions[rank], row))
        row += len(actions[rank])
    done = [False] * pp
    ready.extend(range(pp - 1, -1, -1))             # rank 0 first
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
    return starts, ends, compute
