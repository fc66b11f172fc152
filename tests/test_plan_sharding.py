"""A plan's ZeRO-2/3 priced from its program's own actions (`pipesim.schedule.sharding`), the
program pipeexec runs: ``Plan.build_schedule`` lowers the schedule with
``Parallelism.sharding``; ``derive`` prices each stage's UNSHARD (``costs.unshard``) and
REDUCE_GRAD (``costs.reduce_grad``), a layer a unit, and leaves F / I / W as ZeRO-1's; the
simulator times them on each rank's lane (`pipesim.sim.dataflow`).

Closed forms on one rank (1F1B, m microbatches, ZeRO-3 once a step: an UNSHARD of ``U``
seconds in ``L`` units before each F and B, a REDUCE_GRAD of ``R`` after the last B):

* a fast link (``U`` shorter than every computation): only the first unit's gather shows, and
  of the reduction what the last backward cannot hide, at least its last unit:
  ``U / L + m (F + B) + max(R / L, R - B (1 - 1 / L))``;
* a slow link (``U`` longer than every computation): the gathers run back to back on the lane
  and pace the computations, each ending its last unit's share after its gather:
  ``2 m U + max(R, (B + R) / L)``;

and on two stages, one microbatch, the slow link's chain through both ranks.
"""
from __future__ import annotations

import pytest

import pipesim
from pipesim.plan.model import ModelSpec
from pipesim.schedule.sharding import Sharding

GPT = ModelSpec("gpt", 16, 2048, 16, 1024, 51200)


def plan(zero: int = 3, grad_reduce: str = "per_step", **kw) -> pipesim.Plan:
    base = dict(dp=8, pp=1, global_batch_size=32, zero=zero, grad_reduce=grad_reduce)
    base.update(kw)
    return pipesim.Plan.create(GPT, "H100", **base)


def one_rank_figures(p: pipesim.Plan) -> tuple[float, ...]:
    d = p.derive()
    c = d.costs
    times = c.compute_times(1)
    return (c.unshard[0], c.reduce_grad[0], c.unshard_units[0], times["F"][0], times["B"][0],
            d.tail[0].seconds)


def test_the_program_carries_the_plans_sharding():
    for zero, grad_reduce in ((2, "per_step"), (3, "per_microbatch")):
        p = plan(zero, grad_reduce, pp=2)
        assert p.parallelism.sharding == Sharding(zero, grad_reduce)
        assert p.build_schedule().sharding == Sharding(zero, grad_reduce)
    assert plan(1).build_schedule().sharding is None
    assert plan(3, dp=1, global_batch_size=4).build_schedule().sharding is None   # one replica
    s = pipesim.build_schedule("zbv", pp=2, vpp=2, microbatches=4)
    given = plan(3, pp=2, vpp=2, global_batch_size=32).with_(schedule=s)
    assert given.build_schedule() == s.with_sharding(Sharding(3))


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
@pytest.mark.parametrize("zero,grad_reduce", [(2, "per_step"), (2, "per_microbatch"),
                                              (3, "per_step"), (3, "per_microbatch")])
def test_f_i_w_are_zero1s(schedule, vpp, zero, grad_reduce):
    """derive folds nothing of ZeRO into the computations: their times are ZeRO-1's."""
    kw = dict(pp=2, vpp=vpp, schedule=schedule)
    z1, z = plan(1, **kw).derive().costs, plan(zero, grad_reduce, **kw).derive().costs
    for name in ("forward", "backward", "backward_input", "backward_weight"):
        assert getattr(z, name) == getattr(z1, name), name
    assert z1.unshard == 0.0 and z1.reduce_grad == 0.0
    assert all(x > 0 for x in z.reduce_grad)
    assert all(x > 0 for x in z.unshard) if zero == 3 else not any(z.unshard)


def test_a_fast_link_shows_the_first_units_gather_and_the_last_units_reduction():
    p = plan(3, intra_bandwidth=2e12)
    u, r, units, f, b, tail = one_rank_figures(p)
    assert u < min(f, b)                       # every gather hides under a computation
    m = p.parallelism.microbatches
    step = u / units + m * (f + b) + max(r / units, r - b * (1 - 1 / units)) + tail
    assert pipesim.simulate(p).step_time == pytest.approx(step, rel=1e-12)


def test_a_slow_link_paces_the_computations_by_the_gathers():
    p = plan(3, intra_bandwidth=2e9)
    u, r, units, f, b, tail = one_rank_figures(p)
    assert u > max(f, b)                       # every gather outlasts its computation
    m = p.parallelism.microbatches
    result = pipesim.simulate(p)
    assert result.step_time == pytest.approx(2 * m * u + max(r, (b + r) / units) + tail,
                                             rel=1e-12)
    # the lane is never idle: every UNSHARD starts when the one before it ends
    t = result.trace
    gathers = t[t["op"] == "UNSHARD"]
    assert gathers["start"].tolist() == pytest.approx([k * u for k in range(2 * m)], rel=1e-12)


def test_two_stages_on_a_slow_link_chain_their_gathers_through_both_ranks():
    """pp 2, one microbatch, ZeRO-3 once a step, a slow link: each computation starts on its
    stage's first gathered unit (or its input) and ends its last unit's share after its
    gather; each rank's reduction starts on its B's first unit and ends R after."""
    p = plan(3, dp=4, pp=2, global_batch_size=4, intra_bandwidth=2e9)
    assert p.parallelism.microbatches == 1
    d = p.derive()
    c = d.costs
    times = c.compute_times(2)
    U, R, L = c.unshard, c.reduce_grad, c.unshard_units
    F, B = times["F"], times["B"]
    hop = c.transfer_time(c.p2p_bytes)
    # rank 0: UNSHARD [0, U0], F on the first unit
    s0 = U[0] / L[0]
    f0_end = max(s0 + F[0], U[0] + F[0] / L[0])
    # rank 1: UNSHARD [0, U1], F on its input or its first unit; its B's gather prefetched
    # from F's start (the lane being free by then: U1 ends first)
    f1_start = max(U[1] / L[1], f0_end + hop)
    f1_end = max(f1_start + F[1], U[1] + F[1] / L[1])
    g1 = max(f1_start, U[1])
    b1_start = max(f1_end, g1 + U[1] / L[1])
    b1_end = max(b1_start + B[1], g1 + U[1] + B[1] / L[1])
    r1_start = max(g1 + U[1], b1_start + B[1] / L[1])
    r1_end = max(r1_start + R[1], b1_end + R[1] / L[1])
    # rank 0: B's gather from F's start (after the first), B on the gradient
    g0 = max(s0, U[0])
    b0_start = max(f0_end, g0 + U[0] / L[0], b1_end + hop)
    b0_end = max(b0_start + B[0], g0 + U[0] + B[0] / L[0])
    r0_start = max(g0 + U[0], b0_start + B[0] / L[0])
    r0_end = max(r0_start + R[0], b0_end + R[0] / L[0])
    assert min(U) > max(F + B)                 # the gathers show: the slow link's regime
    result = pipesim.simulate(p)
    assert result.sim.rank_end == pytest.approx([r0_end, r1_end], rel=1e-12)
    assert result.step_time == pytest.approx(max(r0_end + d.tail[0].seconds,
                                                 r1_end + d.tail[1].seconds), rel=1e-12)


def test_the_plan_reports_rows_show_the_sharding_actions():
    r = pipesim.simulate(plan(3, pp=2, global_batch_size=16))
    t = r.trace
    shard = t[t["op"].isin(["UNSHARD", "RESHARD", "REDUCE_GRAD"])]
    assert set(shard["op"].astype(str)) == {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
    m = 2
    assert (t["op"] == "UNSHARD").sum() == (t["op"] == "RESHARD").sum() == 2 * 2 * m
    assert (t["op"] == "REDUCE_GRAD").sum() == 2                 # once a step, each stage
    assert (shard["kind"] == "comm").all()
    from pipesim.sim.chrome import chrome_trace

    lanes = {e["args"]["name"] for e in chrome_trace(t)["traceEvents"]
             if e.get("name") == "thread_name"}
    assert "sharding (data-parallel)" in lanes
    assert not (pipesim.simulate(plan(1, pp=2, global_batch_size=16)).trace["op"]
                .isin(["UNSHARD", "REDUCE_GRAD"]).any())
    pytest.importorskip("matplotlib")
    fig = r.gantt()
    labels = [h.get_label() for h in fig.axes[0].get_legend().legend_handles]
    assert "UNSHARD" in labels and "REDUCE_GRAD" in labels
