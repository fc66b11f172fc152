"""The simulator's fast paths give exactly what the full paths give.

* `pipesim.dataflow.run_dataflow` (async and blocking modes, no SimPy) against the SimPy
  engine `pipesim.engine._run`, span for span, on every builder.
"""
import pytest

import pipesim
from pipesim import CostModel, ScheduleError
from pipesim import engine
from pipesim.dataflow import run_dataflow

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
                     overlap_factor=overlap, **extra)


def engine_inputs(schedule, costs, jitter):
    """What `engine.simulate` hands its runners: actions (overlaps split) and jitter factors."""
    actions = [schedule.actions(r) for r in range(schedule.pp)]
    overlaps = engine._expand_overlaps(schedule, actions, costs) if schedule.has_overlaps else None
    if overlaps is not None:
        actions = overlaps[0]
    factors = engine._jitter(sum(len(a) for a in actions), jitter, seed=7)
    return actions, factors, overlaps


@pytest.mark.parametrize("schedule", list(schedules()))
@pytest.mark.parametrize("comm", ["none", "latency", "bandwidth"])
def test_dataflow_spans_equal_simpy_engine(schedule, comm):
    for overlap in ((1.0, 0.7) if schedule.has_overlaps else (1.0,)):
        costs = costs_for(schedule.num_stages, comm, overlap)
        for blocking in (False, True):
            for jitter in (0.0, 0.3):
                actions, factors, overlaps = engine_inputs(schedule, costs, jitter)
                simpy_spans = engine._run(schedule, actions, costs, factors, blocking,
                                          overlaps=overlaps)
                fast_spans = run_dataflow(schedule, actions, costs, factors, blocking, overlaps)
                assert fast_spans == simpy_spans, (overlap, blocking, jitter)


def test_dataflow_names_the_stuck_ranks():
    """A deadlock (which validate() refuses) is reported, not looped on or silently returned."""
    schedule = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    actions = [schedule.actions(r) for r in range(2)]
    send = next(a for a in actions[0] if a.op == "SEND_F")
    actions[0] = [a for a in actions[0] if a != send] + [send]   # its first output sent last
    costs = CostModel()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0, 1\]"):
        run_dataflow(schedule, actions, costs, None, False)
