"""The simulator's fast paths give exactly what the full paths give.

* `pipesim.sim.dataflow.dataflow_spans` (async and blocking modes, no SimPy) against the SimPy
  engine `pipesim.sim.engine._run`, span for span, on every builder.
* A simulated `SimResult` scores from the engine's arrays and builds its trace only when asked:
  its metrics equal those of `SimResult.from_trace` over that trace, and the trace equals one
  built row by row here from the schedule and the SimPy engine's spans.
"""
import pickle

import pandas as pd
import pytest

import pipesim
from pipesim import CostModel, ScheduleError
from pipesim.sim import engine
from pipesim.sim.dataflow import dataflow_spans
from pipesim.sim.memory import peak_per_rank
from pipesim.schedule.action import flat_parts
from pipesim.schedule.program import lower

NAMES = pipesim.schedule_names()


def schedules():
    """Every builder at a few shapes (the first vpp in 1..3 it accepts), forward-only too."""
    for name in NAMES:
        for pp, m in ((1, 3), (2, 4), (3, 7), (4, 8)):
            for forward_only in (False, True):
                for mm in dict.fromkeys((m, 2 * pp)):
                    built = None
                    for vpp in (1, 2, 3):
                        try:
                            built = pipesim.build_schedule(name, pp=pp, microbatches=mm, vpp=vpp,
                                                           forward_only=forward_only)
                            break
                        except (ScheduleError, ValueError):
                            continue
                    if built is not None:
                        yield pytest.param(built, id=f"{name}-pp{pp}-m{mm}-v{built.vpp}"
                                                     f"{'-fwd' if forward_only else ''}")
                        break


def costs_for(n, comm, overlap):
    """Distinct per-stage costs; no, latency-only or bandwidth-bound communication."""
    extra = {}
    if comm == "latency":
        extra = dict(p2p_latency=0.37)
    elif comm == "bandwidth":
        extra = dict(p2p_latency=0.1, p2p_bandwidth=10.0, p2p_bytes=[3.0 + 7.0 * (s % 4) for s in range(n)])
    return CostModel(forward=[1.0 + 0.13 * (s % 5) for s in range(n)],
                     backward_input=[1.1 + 0.07 * (s % 3) for s in range(n)],
                     backward_weight=[0.9 + 0.11 * (s % 2) for s in range(n)],
                     overlap_factor=overlap, activation_bytes=[100.0 + 10 * s for s in range(n)],
                     weight_grad_fraction=0.3, static_bytes=5.0, stage_static_bytes=7.0,
                     grad_bytes=[50.0] * n, optimizer=0.25, dp_latency=0.01, **extra)


def engine_inputs(schedule, costs, jitter):
    """What `engine.simulate` hands its runners: the lowered program, jitter factors, whether
    an overlap's parts run together, and their scale."""
    program = lower(schedule)
    together = costs.overlaps_parts and bool(program.overlaps)
    scale = engine._overlap_scale(schedule, program, costs) if program.overlaps else None
    factors = engine._jitter(program.num_rows, jitter, seed=7)
    return program, factors, together, scale


@pytest.mark.parametrize("schedule", list(schedules()))
@pytest.mark.parametrize("comm", ["none", "latency", "bandwidth"])
def test_dataflow_spans_equal_simpy_engine(schedule, comm):
    for overlap in ((1.0, 0.7) if schedule.has_overlaps else (1.0,)):
        costs = costs_for(schedule.num_stages, comm, overlap)
        for blocking in (False, True):
            for jitter in (0.0, 0.3):
                program, factors, together, scale = engine_inputs(schedule, costs, jitter)
                simpy_spans = engine._run(program, costs, factors, blocking, together=together,
                                          scale=scale)
                fast_spans = tuple(dataflow_spans(program, costs, factors, blocking, together,
                                                  scale))
                assert fast_spans == simpy_spans, (overlap, blocking, jitter)


def test_dataflow_names_the_stuck_ranks():
    """A deadlock (which validate() refuses) is reported, not looped on or silently returned."""
    schedule = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    actions = [schedule.actions(r) for r in range(2)]
    send = next(a for a in actions[0] if a.op == "SEND_F")
    actions[0] = [a for a in actions[0] if a != send] + [send]   # its first output sent last
    costs = CostModel()
    stuck = pipesim.Schedule(2, 1, 2, "looped", actions)          # not validated
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0, 1\]"):
        dataflow_spans(lower(stuck), costs, None, False)


def reference_trace(schedule, costs, comm, jitter):
    """The trace built row by row: columns from the actions (overlaps split here), spans from
    SimPy."""
    program, factors, together, scale = engine_inputs(schedule, costs, jitter)
    starts, ends = engine._run(program, costs, factors, comm == "blocking", comm == "rendezvous",
                               together=together, scale=scale)
    actions = [flat_parts(schedule.actions(r)) for r in range(schedule.pp)]
    n, place = schedule.num_stages, schedule.placement
    nbytes = costs.stage_values("p2p_bytes", n)
    rows, i = [], 0
    for rank, acts in enumerate(actions):
        for op, stage, mb in acts:
            comm_row = op.startswith(("SEND", "RECV"))
            peer_stage = stage + (1 if op in ("SEND_F", "RECV_B") else -1) if comm_row else stage
            rows.append({"rank": rank, "op": op, "stage": stage,
                         "chunk": schedule.stage_chunk(stage), "microbatch": mb,
                         "start": starts[i], "end": ends[i],
                         "kind": "comm" if comm_row else "compute",
                         "bytes": float(nbytes[min(stage, peer_stage)]) if comm_row else 0.0,
                         "peer": place[peer_stage] if comm_row else -1})
            i += 1
    frame = pd.DataFrame(rows)
    frame["op"] = pd.Categorical(frame["op"], categories=["F", "B", "I", "W", "SEND_F", "RECV_F",
                                                          "SEND_B", "RECV_B", "ALLREDUCE",
                                                          "OPTIMIZER"])
    frame["kind"] = pd.Categorical(frame["kind"], categories=["compute", "comm"])
    return frame


METRICS = ("makespan", "rank_end", "busy", "idle", "span", "bubble", "comm_wait", "bubble_fraction",
           "slowest_rank", "bubble_rate", "bubble_time", "peak_inflight", "peak_memory")
TRACE_METRICS = ("comm_wait", "peak_inflight")                # read from the trace DataFrame


@pytest.mark.parametrize("schedule", list(schedules()))
@pytest.mark.parametrize("comm", ["async", "blocking", "rendezvous"])
def test_lazy_result_equals_its_trace(schedule, comm):
    costs = costs_for(schedule.num_stages, "bandwidth", 0.7 if schedule.has_overlaps else 1.0)
    for jitter in (0.0, 0.3):
        options = dict(comm=comm, jitter=jitter, seed=7)
        lazy = pipesim.simulate(schedule, costs, **options)
        memory = lazy.memory_timeline                       # from the compute rows alone
        got = {name: getattr(lazy, name) for name in METRICS if name not in TRACE_METRICS}
        assert "trace" not in vars(lazy)                    # nothing built yet
        got.update({name: getattr(lazy, name) for name in TRACE_METRICS})
        assert "trace" in vars(lazy)                        # comm_wait and peak_inflight read it
        full = pipesim.SimResult.from_trace(lazy.trace, schedule, costs=costs)
        assert got == {name: getattr(full, name) for name in METRICS}
        pd.testing.assert_frame_equal(lazy.trace, reference_trace(schedule, costs, comm, jitter),
                                      check_exact=True)
        pd.testing.assert_frame_equal(memory, full.memory_timeline, check_exact=True)
        assert peak_per_rank(memory, schedule.pp) == lazy.peak_memory
        # the other engine paths (step tail, shared cores) score alike too
        for extra in (dict(step_tail=True, dp=4), dict(cores=1.5)):
            other = pipesim.simulate(schedule, costs, **options, **extra)
            again = pipesim.SimResult.from_trace(other.trace, schedule, costs=costs)
            assert {name: getattr(other, name) for name in METRICS} == \
                {name: getattr(again, name) for name in METRICS}, extra


def test_time_metrics_need_no_trace():
    """What the planner reads (time, bubbles, peak memory) costs no DataFrame; the trace is
    built once, on first access, and cached."""
    schedule = pipesim.build_schedule("interleaved", pp=4, microbatches=8, vpp=2)
    r = pipesim.simulate(schedule, costs_for(schedule.num_stages, "bandwidth", 1.0))
    assert r.makespan > 0 and r.bubble_fraction > 0 and r.bubble_rate > 0 and max(r.busy) > 0
    assert min(r.peak_memory) > 0 and max(r.rank_end) == r.makespan
    assert "trace" not in vars(r) and "memory_timeline" not in vars(r)
    again = pickle.loads(pickle.dumps(r))                  # e.g. back from a process pool
    assert r.trace is r.trace
    pd.testing.assert_frame_equal(again.trace, r.trace, check_exact=True)
    assert {name: getattr(again, name) for name in METRICS} == \
        {name: getattr(r, name) for name in METRICS}
