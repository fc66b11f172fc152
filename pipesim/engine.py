"""`simulate`: a SimPy discrete-event model of one training step of a schedule.

One SimPy process per rank walks ``schedule.actions(rank)``. The only coupling between ranks is
a message (an activation or a gradient) crossing a link, so the model makes events only there:

* a rank runs its compute and sends on a local clock ``t`` (``t >= env.now`` always) with no
  SimPy event per action: its own work depends only on its own order and on what it receives;
* a SEND occupies the directed link ``sender -> receiver`` for ``latency + bytes / bandwidth``
  seconds, starting when both the data and the link are free: one transfer per direction at a
  time, first in, first out. A directed link has one sender, so its queue follows that rank's
  order and needs no global arbitration;
* a RECV posts a receive; the computation that needs the message waits for it (as the
  executor does). A message that has not arrived yet parks the process on an event; the sender
  schedules it at the arrival time, so ``env.now`` is the simulated time at every wake-up. The
  RECV row of the trace spans that wait: from when the consumer was ready to start to the
  arrival (zero-length at the consumer's start if the data was there).

The result is the same as stepping every action as a SimPy timeout (the tests check it against
an independent list scheduler), at a fraction of the events. In the ``async`` and ``blocking``
modes no result depends on the order of events in time, so `simulate` runs them without SimPy,
as a dataflow over a ready list (:mod:`pipesim.dataflow`, checked span for span against
`_run`); the result keeps the engine's arrays (:class:`pipesim.spans.Spans`) and builds the
trace DataFrame only when it is read. Modes: ``comm="async"`` (the
default; a send is posted and the rank goes on, as with ``isend``, and the data moves at once:
receives count as pre-posted), ``"blocking"`` (the sender waits until its transfer has arrived;
receives are pre-posted, so there is no rendezvous and no deadlock that the asynchronous
schedule does not have) or ``"rendezvous"`` (sends are posted and the rank goes on, but a
transfer starts only once the receiver has posted its receive, i.e. reached the RECV action:
how gloo and NCCL move a point-to-point message. A receive posted right before the computation
that needs it then always waits the transfer time; one posted earlier (``recv_lookahead``)
overlaps it with the computations in between. Each such transfer is one SimPy event at
the moment both sides are ready, so a directed link serves transfers in the order they become
ready). The model is deterministic; ``jitter``
multiplies every compute time by a factor drawn uniformly from ``[1 - jitter, 1 + jitter]`` with
a generator seeded by ``seed``, in rank then action order.
"""
from __future__ import annotations

import random
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np
import simpy
from simpy.events import NORMAL

from .costs import CostModel
from .dataflow import run_dataflow
from .spans import OPS, Spans
from .schedule.action import B, F, I, OVERLAP_F_B, RECV_B, RECV_F, SEND_B, SEND_F, W
from .schedule.schedule import Schedule

if TYPE_CHECKING:
    from .result import SimResult

COMM_MODES = ("async", "blocking", "rendezvous")


def simulate(schedule: Schedule, costs: CostModel | None = None, *, comm: str = "async",
             step_tail: bool = False, dp: int = 1, jitter: float = 0.0, seed: int = 0,
             cores: float | None = None) -> "SimResult":
    """Simulate one step of ``schedule`` under ``costs``; return a :class:`pipesim.SimResult`.

    ``step_tail`` appends, on every rank after its last action and outgoing transfer, the
    data-parallel gradient all-reduce over ``dp`` replicas and the optimizer step (see
    :class:`CostModel`). ``cores``: the ranks share that many processors (more ranks than
    cores, as CPU runs on a small machine): compute costs are then work, and the ranks computing
    at any moment each progress at ``min(1, cores / computing)`` of it (processor sharing), so a
    computation's duration depends on what the other ranks do meanwhile. Raises
    :class:`pipesim.ScheduleError` for an invalid schedule and ValueError for costs that do not
    fit it.
    """
    from .result import SimResult

    costs = CostModel() if costs is None else costs
    if comm not in COMM_MODES:
        raise ValueError(f"comm must be one of {', '.join(COMM_MODES)}, got {comm!r}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if cores is not None and not (isinstance(cores, (int, float)) and cores > 0):
        raise ValueError(f"cores must be a positive number or None, got {cores!r}")
    schedule.validate()
    costs = costs.for_schedule(schedule)       # per-part costs onto copies (DualPipe)
    costs.check_shape(schedule.num_stages, schedule.pp)
    actions = [schedule.actions(r) for r in range(schedule.pp)]
    overlaps = _expand_overlaps(schedule, actions, costs) if schedule.has_overlaps else None
    if overlaps is not None:
        actions = overlaps[0]
    factors = _jitter(sum(map(len, actions)), jitter, seed)
    shared = cores if cores is not None and cores < schedule.pp else None
    options = {"comm": comm, "step_tail": step_tail, "dp": dp, "jitter": jitter, "seed": seed,
               "cores": cores}
    if comm != "rendezvous" and shared is None and not step_tail:
        # A dataflow (no event heap); the timing-free columns wait until the trace is asked for.
        starts, ends, compute = run_dataflow(schedule, actions, costs, factors,
                                             comm == "blocking", overlaps)
        rank = np.repeat(np.arange(schedule.pp, dtype=np.int64), [len(c) for c in compute])
        row_rank = np.repeat(np.arange(schedule.pp, dtype=np.int64), [len(a) for a in actions])
        spans = Spans(np.asarray(starts, dtype=float), np.asarray(ends, dtype=float), row_rank,
                      np.fromiter(chain.from_iterable(compute), dtype=np.int64, count=len(rank)),
                      rank, lambda: _columns(schedule, actions, costs),
                      lambda: _compute_ops(schedule))
        return SimResult.from_spans(spans, schedule=schedule, costs=costs, options=options)
    columns = _columns(schedule, actions, costs)
    if comm == "rendezvous" or shared is not None:      # depend on event order in time
        starts, ends = _run(schedule, actions, costs, factors, comm == "blocking",
                            comm == "rendezvous", shared, overlaps)
    else:
        starts, ends, _ = run_dataflow(schedule, actions, costs, factors, comm == "blocking",
                                       overlaps)
    if step_tail:
        _append_tail(schedule, costs, dp, columns, starts, ends)
    compute_rows = np.flatnonzero(columns["kind"] == 0)
    spans = Spans(np.asarray(starts, dtype=float), np.asarray(ends, dtype=float), columns["rank"],
                  compute_rows, columns["rank"][compute_rows], lambda: columns)
    return SimResult.from_spans(spans, schedule=schedule, costs=costs, options=options)


# Op codes of the trace's categorical ``op`` column (step-tail ops last).
_OP_CODE = {op: code for code, op in enumerate(OPS)}


class _Arrival(simpy.Event):
    """What a receiver waits on: its sender fires it at the message's arrival time.

    Like :class:`simpy.Timeout` (whose constructor does the same), but created by the waiter
    before the time is known: one event and one heap entry per wait.
    """

    def fire_at(self, time: float) -> None:
        self._ok = True
        self._value = time
        self.env.schedule(self, NORMAL, time - self.env.now)


class _SharedCores:
    """Processor sharing: the ``n`` computations in progress each advance at ``min(1, cores/n)``
    units of work per second. A computation is one job; whenever the set of jobs changes, the
    work done since the last change is booked and the next completion is scheduled (earlier
    timers are superseded by a generation number)."""

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        self.env, self.cores = env, cores
        self.jobs: list[list] = []          # [remaining work, event]
        self.last = 0.0
        self.generation = 0

    def run(self, work: float) -> simpy.Event:
        """An event that fires, with the time, when ``work`` has been done."""
        self._book()
        done = simpy.Event(self.env)
        self.jobs.append([work, done])
        self._next()
        return done

    def _rate(self) -> float:
        n = len(self.jobs)
        return 1.0 if n <= self.cores else self.cores / n

    def _book(self) -> None:
        now = self.env.now
        if self.jobs and now > self.last:
            done = (now - self.last) * self._rate()
            for job in self.jobs:
                job[0] -= done
        self.last = now

    def _next(self) -> None:
        self.generation += 1
        if self.jobs:
            wait = max(0.0, min(job[0] for job in self.jobs)) / self._rate()
            timer = self.env.timeout(wait, value=self.generation)
            timer.callbacks.append(self._tick)

    def _tick(self, timer: simpy.Event) -> None:
        if timer.value != self.generation:
            return                          # the job set changed since this was scheduled
        self._book()
        least = min(job[0] for job in self.jobs)
        finished = [job for job in self.jobs if job[0] <= least + 1e-12]
        self.jobs = [job for job in self.jobs if job[0] > least + 1e-12]
        for _, event in finished:
            event.succeed(self.env.now)
        self._next()


def _expand_overlaps(schedule: Schedule, actions: list[list], costs: CostModel
                     ) -> tuple[list[list], dict[int, tuple], dict[int, float]]:
    """Split each ``OVERLAP_F_B`` into its parts, one trace row each (so busy time, memory and
    plots read them as usual), and say how to run them: ``gate[row]`` is the backward part
    whose input the forward part's row also waits for (when the parts run together, the overlap
    starts once both inputs are there; with ``overlap_factor`` 1.0 they run in turn, as
    pipeexec and torch run them, and each waits for its own), ``scale[row]`` stretches both
    parts so that together they take :meth:`CostModel.overlap_time`."""
    times = costs.compute_times(schedule.num_stages)
    flat: list[list] = []
    gate: dict[int, tuple] = {}
    scale: dict[int, float] = {}
    row = 0
    for acts in actions:
        out = []
        for a in acts:
            if a.op != OVERLAP_F_B:
                out.append(a)
                row += 1
                continue
            parts = a.parts
            alone = [times[p.op][p.stage] for p in parts]
            total = sum(alone)
            ratio = costs.overlap_time(parts, alone) / total if total > 0 else 1.0
            if costs.overlaps_parts:        # run together: both inputs first
                gate[row] = tuple(parts[1])
            for p in parts:
                out.append(p)
                scale[row] = ratio
                row += 1
        flat.append(out)
    return flat, gate, scale


def _jitter(rows: int, jitter: float, seed: int) -> list[float] | None:
    """One factor per trace row (rank, then action order), uniform in [1 - jitter, 1 + jitter]."""
    if not jitter:
        return None
    rng = random.Random(seed)
    lo, span = 1.0 - jitter, 2.0 * jitter
    return [lo + span * rng.random() for _ in range(rows)]


def _columns(schedule: Schedule, actions: list[list], costs: CostModel) -> dict:
    """The trace's columns that do not depend on timing, as numpy arrays, row = (rank, action)."""
    import numpy as np

    pp, n = schedule.pp, schedule.num_stages
    nbytes = costs.stage_values("p2p_bytes", n)
    flat = list(chain.from_iterable(actions))       # C-level maps below, no Python loop
    rows = len(flat)
    code = np.fromiter(map(_OP_CODE.__getitem__, map(itemgetter(0), flat)), dtype=np.int8, count=rows)
    stage = np.fromiter(map(itemgetter(1), flat), dtype=np.int64, count=rows)
    mb = np.fromiter(map(itemgetter(2), flat), dtype=np.int64, count=rows)
    chunk_of = np.asarray([schedule.stage_chunk(s) for s in range(n)], dtype=np.int64)
    place = np.asarray(schedule.placement, dtype=np.int64)
    # Peer stage: +1 for SEND_F / RECV_B, -1 for RECV_F / SEND_B.
    step = np.select([(code == 4) | (code == 7), (code == 5) | (code == 6)], [1, -1], 0)
    peer_stage = np.clip(stage + step, 0, n - 1)
    is_comm = code >= 4
    # A forward message carries the output of the lower stage; a backward one the gradient of
    # the upper stage's input, which is again the output of the lower stage.
    lower = np.minimum(stage, peer_stage)
    return {
        "rank": np.repeat(np.arange(pp, dtype=np.int64), [len(a) for a in actions]),
        "op": code, "stage": stage, "chunk": chunk_of[stage], "microbatch": mb,
        "kind": is_comm.astype(np.int8),
        "bytes": np.where(is_comm, np.asarray(nbytes, dtype=float)[lower], 0.0),
        "peer": np.where(is_comm, place[peer_stage], -1),
    }


def _compute_ops(schedule: Schedule) -> tuple:
    """(op names, stage, microbatch) of the compute rows, in row order: each rank's compute
    parts (an overlap's parts in turn), as the split actions hold them between the comms."""
    import numpy as np

    flat = list(chain.from_iterable(schedule.compute_parts(r) for r in range(schedule.pp)))
    rows = len(flat)
    return (np.fromiter(map(itemgetter(0), flat), dtype=object, count=rows),
            np.fromiter(map(itemgetter(1), flat), dtype=np.int64, count=rows),
            np.fromiter(map(itemgetter(2), flat), dtype=np.int64, count=rows))


def _run(schedule: Schedule, actions: list[list], costs: CostModel, factors: list[float] | None,
         blocking: bool, rendezvous: bool = False, cores: float | None = None,
         overlaps: tuple | None = None) -> tuple[list[float], list[float]]:
    """Run the SimPy model; return the start and end time of every row (rank, action order).

    Messages are numbered ``(direction * n + receiving stage) * m + microbatch``; the directed
    link ``a -> b`` is ``a * pp + b``.

    ``rendezvous``: a SEND only records when it was posted (and its row); the transfer is placed
    on its link by `ready` at ``max(send posted, receive posted)``. That moment is never before
    ``env.now`` (it is the local clock of the rank posting second, and local clocks run at or
    ahead of ``env.now``), so ready events are processed in time order and the link's FIFO is
    the order in which transfers became ready.

    ``cores``: computations go through `_SharedCores`; a rank's clock then cannot run ahead of
    ``env.now`` into a computation (its speed depends on the others), so it first catches up.

    ``overlaps``: from `_expand_overlaps` (the actions are then already split into parts).
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
    arrival = [-1.0] * (2 * n * m)
    waiters: list = [None] * (2 * n * m)
    link_free = [0.0] * (pp * pp)
    env = simpy.Environment()
    shared = _SharedCores(env, cores) if cores is not None else None
    done = [False] * pp
    recv_row = [-1] * (2 * n * m)                  # msg -> row of its posted RECV
    send_post = [-1.0] * (2 * n * m) if rendezvous else None
    recv_post = [-1.0] * (2 * n * m) if rendezvous else None
    send_of: list = [None] * (2 * n * m) if rendezvous else None   # msg -> (row, link, seconds)
    gate, scale = (overlaps[1], overlaps[2]) if overlaps is not None else (None, None)

    def ready(msg: int, at: float) -> None:
        """Both sides have posted ``msg`` at time ``at``: start its transfer then (or when the
        link frees), at simulated time ``at`` so that links serve transfers in time order."""
        def start(_event, msg=msg):
            row, link, c = send_of[msg]
            s = link_free[link]
            if s < env.now:
                s = env.now
            e = s + c
            link_free[link] = e
            arrival[msg] = e
            starts[row] = s
            ends[row] = e
            ev = waiters[msg]
            if ev is not None:
                ev.fire_at(e)
        event = simpy.Event(env)
        event.callbacks.append(start)
        event._ok = True
        event._value = None
        env.schedule(event, NORMAL, at - env.now)

    def rank_process(rank: int, acts: list, row: int):
        t = 0.0
        base = rank * pp
        for op, stage, mb in acts:
            d = durations.get(op)
            if d is not None:                       # F, B, I, W
                if gate is not None and row in gate:
                    # The forward part of an overlap: its backward part's input must be here too.
                    _, bs, bmb = gate[row]
                    msg = (n + bs) * m + bmb
                    r = recv_row[msg]
                    if r >= 0:
                        e = arrival[msg]
                        if e < 0.0:
                            ev = waiters[msg] = _Arrival(env)
                            e = yield ev
                        starts[r] = t
                        if e > t:
                            t = e
                        ends[r] = t
                        recv_row[msg] = -1          # waited for: the backward part goes on
                # The wait for a posted receive happens here, in the compute that needs it.
                if op != W:
                    msg = stage * m + mb if op == F else (n + stage) * m + mb
                    r = recv_row[msg]
                    if r >= 0:
                        e = arrival[msg]
                        if e < 0.0:
                            ev = waiters[msg] = _Arrival(env)
                            e = yield ev
                        starts[r] = t
                        if e > t:
                            t = e
                        ends[r] = t
                work = d[stage] if factors is None else d[stage] * factors[row]
                if scale is not None and row in scale:
                    work *= scale[row]
                if shared is not None:
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    starts[row] = t
                    t = yield shared.run(work)
                else:
                    starts[row] = t
                    t += work
                ends[row] = t
            elif op == RECV_F or op == RECV_B:      # post only
                msg = stage * m + mb if op == RECV_F else (n + stage) * m + mb
                recv_row[msg] = row
                starts[row] = ends[row] = t         # until the consumer waits
                if rendezvous:
                    recv_post[msg] = t
                    if send_post[msg] >= 0.0:
                        ready(msg, t if t > send_post[msg] else send_post[msg])
            else:                                   # SEND_F, SEND_B
                if op == SEND_F:
                    msg, link, c = (stage + 1) * m + mb, base + placement[stage + 1], fwd_time[stage]
                else:
                    msg, link, c = (n + stage - 1) * m + mb, base + placement[stage - 1], bwd_time[stage]
                if rendezvous:
                    send_post[msg] = t
                    send_of[msg] = (row, link, c)
                    starts[row] = ends[row] = t          # until the transfer is placed
                    if recv_post[msg] >= 0.0:
                        ready(msg, t if t > recv_post[msg] else recv_post[msg])
                    row += 1
                    continue
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
                ev = waiters[msg]
                if ev is not None:
                    ev.fire_at(e)
            row += 1
        done[rank] = True

    row = 0
    for rank in range(pp):
        env.process(rank_process(rank, actions[rank], row))
        row += len(actions[rank])
    env.run()
    if not all(done):
        stuck = [r for r in range(pp) if not done[r]]
        raise RuntimeError(f"simulation stopped with rank(s) {stuck} waiting on a receive; "
                           "validate() should have caught this deadlock")
    return starts, ends


def _append_tail(schedule: Schedule, costs: CostModel, dp: int, columns: dict,
                 starts: list[float], ends: list[float]) -> None:
    """All-reduce then optimizer step on each rank, after its last action and outgoing transfer."""
    import numpy as np

    n, pp = schedule.num_stages, schedule.pp
    grad = costs.stage_values("grad_bytes", n)
    opt = costs.stage_values("optimizer", n)
    extra: dict[str, list] = {name: [] for name in columns}
    last_end = np.zeros(pp)
    np.maximum.at(last_end, columns["rank"], np.asarray(ends))
    for rank in range(pp):
        stages = schedule.rank_stages(rank)
        t = float(last_end[rank])
        size = sum(grad[s] for s in stages)
        for code, kind, dur, nbytes in ((len(OPS), 1, costs.allreduce_time(size, dp), size),
                                        (len(OPS) + 1, 0, sum(opt[s] for s in stages), 0.0)):
            for name, value in (("rank", rank), ("op", code), ("stage", -1), ("chunk", -1),
                                ("microbatch", -1), ("kind", kind), ("bytes", nbytes), ("peer", -1)):
                extra[name].append(value)
            starts.append(t)
            t += dur
            ends.append(t)
    for name, values in extra.items():
        columns[name] = np.concatenate((columns[name], np.asarray(values, dtype=columns[name].dtype)))
