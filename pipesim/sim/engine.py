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
as a dataflow over a ready list (:mod:`pipesim.sim.dataflow`, checked span for span against
`_run`); the result keeps the engine's arrays (:class:`pipesim.sim.spans.Spans`) and builds the
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

import numpy as np
import simpy
from simpy.events import NORMAL

from ..plan.costs import CostModel
from .dataflow import Clocks, dataflow_spans, walk
from .result import SimResult
from .rows import row_arrays
from .spans import Spans
from ..schedule.op import CODE_ALLREDUCE, CODE_OPTIMIZER, FIRST_COMM_CODE, FIRST_SHARD_CODE
from ..schedule.program import Program, Row, lower
from ..schedule.schedule import Schedule

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
    costs = CostModel() if costs is None else costs
    if not (comm == "async" and jitter == 0 and type(dp) is int and dp == 1 and cores is None):
        _check_options(comm, jitter, dp, cores)
    schedule.validate()
    if schedule.stage_parts is not None:        # per-part costs onto copies (DualPipe)
        costs = costs.for_schedule(schedule)
    program = lower(schedule)
    together = bool(program.overlaps) and costs.overlaps_parts   # parts run together: both inputs
    # parts that run in turn take what they take alone: no factor (x * 1.0 is x, to the bit)
    scale = _overlap_scale(schedule, program, costs) if together else None
    factors = _jitter(program.num_rows, jitter, seed) if jitter else None
    shared = cores if cores is not None and cores < program.pp else None
    options = {"comm": comm, "step_tail": step_tail, "dp": dp, "jitter": jitter, "seed": seed,
               "cores": cores}
    if comm == "rendezvous" or shared is not None:      # depend on event order in time
        starts, ends = _run(program, costs, factors, comm == "blocking", comm == "rendezvous",
                            shared, together, scale)
    else:
        # A dataflow (no event heap); the timing-free columns wait until the trace is asked for.
        starts, ends = dataflow_spans(program, costs, factors, comm == "blocking", together,
                                      scale)
    if not step_tail:
        rows = row_arrays(program)
        spans = Spans(starts, ends, rows.row_rank, rows.compute_rows, rows.compute_rank,
                      lambda: _columns(schedule, program, costs), rows)
        return SimResult.from_spans(spans, schedule=schedule, costs=costs, options=options)
    columns = _columns(schedule, program, costs)
    _append_tail(schedule, costs, dp, columns, starts, ends)
    compute_rows = np.flatnonzero(columns["kind"] == 0)
    spans = Spans(np.asarray(starts, dtype=float), np.asarray(ends, dtype=float), columns["rank"],
                  compute_rows, columns["rank"][compute_rows], lambda: columns)
    return SimResult.from_spans(spans, schedule=schedule, costs=costs, options=options)


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


def _check_options(comm: str, jitter: float, dp: int, cores: float | None) -> None:
    """Raise ValueError naming the first of `simulate`'s options that is out of range."""
    if comm not in COMM_MODES:
        raise ValueError(f"comm must be one of {', '.join(COMM_MODES)}, got {comm!r}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if cores is not None and not (isinstance(cores, (int, float)) and cores > 0):
        raise ValueError(f"cores must be a positive number or None, got {cores!r}")


def _overlap_scale(schedule: Schedule, program: Program, costs: CostModel) -> dict[int, float]:
    """Per row of an overlap's parts (the program splits them), the factor that stretches both
    so that together they take :meth:`CostModel.overlap_time` (1.0 when the parts run in turn,
    as pipeexec and torch run them)."""
    times = costs.compute_times(schedule.num_stages)
    scale: dict[int, float] = {}
    for fwd, bwd in program.overlaps:
        f_rank, f_i = program.rank_of_row(fwd)
        rows = program.in_turn[f_rank]
        parts = [Row(*rows[f_i]).action, Row(*rows[f_i + 1]).action]
        alone = [times[p.op][p.stage] for p in parts]
        total = sum(alone)
        scale[fwd] = scale[bwd] = costs.overlap_time(parts, alone) / total if total > 0 else 1.0
    return scale


def _jitter(rows: int, jitter: float, seed: int) -> list[float] | None:
    """One factor per trace row (rank, then action order), uniform in [1 - jitter, 1 + jitter]."""
    if not jitter:
        return None
    rng = random.Random(seed)
    lo, span = 1.0 - jitter, 2.0 * jitter
    return [lo + span * rng.random() for _ in range(rows)]


def _columns(schedule: Schedule, program: Program, costs: CostModel) -> dict:
    """The trace's columns that do not depend on timing, as numpy arrays, row = (rank, row)."""
    pp, n = schedule.pp, schedule.num_stages
    nbytes = np.asarray(costs.stage_values("p2p_bytes", n), dtype=float)
    flat = list(chain.from_iterable(program.in_turn))   # C-level maps below, no Python loop
    rows = len(flat)
    code = np.fromiter(map(itemgetter(0), flat), dtype=np.int8, count=rows)
    stage = np.fromiter(map(itemgetter(1), flat), dtype=np.int64, count=rows)
    mb = np.fromiter(map(itemgetter(2), flat), dtype=np.int64, count=rows)
    boundary = np.fromiter(map(itemgetter(9), flat), dtype=np.int64, count=rows)
    chunk_of = np.asarray([schedule.stage_chunk(s) for s in range(n)], dtype=np.int64)
    place = np.asarray(schedule.placement, dtype=np.int64)
    is_comm = code >= FIRST_COMM_CODE
    is_p2p = is_comm & (code < FIRST_SHARD_CODE)    # (a sharding row: a comm row, no peer)
    # A comm row's peer is across its boundary (the lower stage of the two): a forward message
    # carries the lower stage's output, a backward one the gradient of the upper stage's input,
    # which is again the lower stage's output: its bytes are the boundary's.
    peer_stage = np.where(boundary == stage, boundary + 1, boundary)
    return {
        "rank": np.repeat(np.arange(pp, dtype=np.int64), [len(r) for r in program.in_turn]),
        "op": code, "stage": stage, "chunk": chunk_of[stage], "microbatch": mb,
        "kind": is_comm.astype(np.int8),
        "bytes": np.where(is_p2p, nbytes[np.clip(boundary, 0, n - 1)], 0.0),
        "peer": np.where(is_p2p, place[np.clip(peer_stage, 0, n - 1)], -1),
    }


def _run(program: Program, costs: CostModel, factors: list[float] | None, blocking: bool,
         rendezvous: bool = False, cores: float | None = None, together: bool = False,
         scale: dict[int, float] | None = None) -> tuple[list[float], list[float]]:
    """Run the SimPy model; return the start and end time of every row (rank, row order).

    Each rank is :func:`pipesim.sim.dataflow.walk` over its rows, driven by a SimPy process: a wait
    for a message not yet sent parks it on an event its sender fires at the arrival time.

    ``rendezvous``: a SEND only records when it was posted (and its row); the transfer is placed
    on its link by `ready` at ``max(send posted, receive posted)``. That moment is never before
    ``env.now`` (it is the local clock of the rank posting second, and local clocks run at or
    ahead of ``env.now``), so ready events are processed in time order and the link's FIFO is
    the order in which transfers became ready.

    ``cores``: computations go through `_SharedCores`; a rank's clock then cannot run ahead of
    ``env.now`` into a computation (its speed depends on the others), so it first catches up.
    """
    pp = program.pp
    clocks = Clocks(program, costs, parking=True)
    starts, ends, arrival, waiters = clocks.starts, clocks.ends, clocks.arrival, clocks.waiter
    link_free = clocks.link_free
    env = simpy.Environment()
    shared = _SharedCores(env, cores) if cores is not None else None
    done = [False] * pp
    msgs = program.num_messages
    send_post = [-1.0] * msgs if rendezvous else None
    recv_post = [-1.0] * msgs if rendezvous else None
    send_of: list = [None] * msgs if rendezvous else None   # msg -> (row, link, seconds)

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
                waiters[msg] = None
                ev.fire_at(e)
        event = simpy.Event(env)
        event.callbacks.append(start)
        event._ok = True
        event._value = None
        env.schedule(event, NORMAL, at - env.now)

    def on_send(msg: int, row: int, link: int, c: float, t: float) -> None:
        send_post[msg] = t
        send_of[msg] = (row, link, c)
        if recv_post[msg] >= 0.0:
            ready(msg, t if t > recv_post[msg] else recv_post[msg])

    def on_recv(msg: int, t: float) -> None:
        recv_post[msg] = t
        if send_post[msg] >= 0.0:
            ready(msg, t if t > send_post[msg] else send_post[msg])

    def wake(event: "_Arrival", e: float) -> None:
        event.fire_at(e)

    def process(rank: int, steps):
        """The SimPy side of one rank's walk: park on messages, run computations on the
        shared cores."""
        request = next(steps, None)
        while request is not None:
            if isinstance(request, tuple):              # (local clock, work) on shared cores
                t, work = request
                if t > env.now:
                    yield env.timeout(t - env.now)
                end = yield shared.run(work)
                request = _resume(steps, end)
            else:                                       # a message not yet sent
                event = waiters[request] = _Arrival(env)
                yield event
                request = _resume(steps, None)
        done[rank] = True

    for rank, steps in enumerate(program.steps(together, posts=rendezvous)):
        walker = walk(steps, clocks, wake, factors, scale, blocking,
                      on_send if rendezvous else None, on_recv if rendezvous else None,
                      shared is not None)
        env.process(process(rank, walker))
    env.run()
    if not all(done):
        stuck = [r for r in range(pp) if not done[r]]
        raise RuntimeError(f"simulation stopped with rank(s) {stuck} waiting on a receive; "
                           "validate() should have caught this deadlock")
    return starts, ends


def _resume(steps, value):
    """The walk's next request after sending it ``value``; None once it has finished."""
    try:
        return steps.send(value)
    except StopIteration:
        return None


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
        for code, kind, dur, nbytes in ((CODE_ALLREDUCE, 1, costs.allreduce_time(size, dp), size),
                                        (CODE_OPTIMIZER, 0, sum(opt[s] for s in stages), 0.0)):
            for name, value in (("rank", rank), ("op", code), ("stage", -1), ("chunk", -1),
                                ("microbatch", -1), ("kind", kind), ("bytes", nbytes), ("peer", -1)):
                extra[name].append(value)
            starts.append(t)
            t += dur
            ends.append(t)
    for name, values in extra.items():
        columns[name] = np.concatenate((columns[name], np.asarray(values, dtype=columns[name].dtype)))
