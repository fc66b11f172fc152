"""The simulator times ZeRO's actions from the program (`pipesim.schedule.sharding`): UNSHARD
and REDUCE_GRAD on each rank's own communication lane (`CostModel.unshard`,
``reduce_grad``, ``overlap_sharding``), RESHARD free; the trace, the Gantt and the Chrome
trace show them.

Closed forms on one rank (F = 1, B = 2, two microbatches, ZeRO-3 once a step: UNSHARD before
each of the four computations, REDUCE_GRAD after the last B):

* overlapped (prefetched one computation ahead), a gather no longer than a computation: only
  the first shows, ``u + 6 + r``; a longer one paces the computations: each starts ``u`` after
  the previous one started (``max(x, u)`` per computation after the first: the plan's model);
* blocking (pipeexec on one stream): every one on the path, ``4u + 6 + r``.

And: an unsharded schedule's result does not depend on these costs; the SimPy engine
(rendezvous, shared cores) walks the same rows as the dataflow; the cost model's JSON keeps
them and, unset, writes nothing new.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import pipesim
from pipesim import CostModel
from pipesim.schedule.sharding import Sharding
from pipesim.sim.chrome import chrome_trace

F_, B_ = 1.0, 2.0


def one_rank(zero=3, reduce="per_step"):
    return pipesim.build_schedule("1f1b", pp=1, microbatches=2).with_sharding(Sharding(zero, reduce))


@pytest.mark.parametrize("u", [0.5, 1.0])
def test_overlapped_gathers_no_longer_than_a_computation_show_once(u):
    r = pipesim.simulate(one_rank(), CostModel(forward=F_, backward=B_, unshard=u,
                                               reduce_grad=0.25))
    assert r.makespan == pytest.approx(u + 2 * (F_ + B_) + 0.25)


def test_a_longer_gather_paces_the_computations():
    u = 3.0
    r = pipesim.simulate(one_rank(), CostModel(forward=F_, backward=B_, unshard=u,
                                               reduce_grad=0.25))
    t = r.trace
    comp = t[t["kind"] == "compute"]
    starts = comp["start"].to_numpy()
    assert starts.tolist() == pytest.approx([u, 2 * u, 3 * u, 4 * u])
    assert r.makespan == pytest.approx(4 * u + B_ + 0.25)
    gathers = t[t["op"] == "UNSHARD"]
    # each gather starts with the computation before it (the first at 0), one at a time
    assert gathers["start"].tolist() == pytest.approx([0.0, u, 2 * u, 3 * u])
    assert (gathers["end"] - gathers["start"]).tolist() == pytest.approx([u] * 4)


@pytest.mark.parametrize("u", [0.5, 3.0])
def test_blocking_puts_every_collective_on_the_path(u):
    r = pipesim.simulate(one_rank(), CostModel(forward=F_, backward=B_, unshard=u,
                                               reduce_grad=0.25, overlap_sharding=0.0))
    assert r.makespan == pytest.approx(4 * u + 2 * (F_ + B_) + 0.25)


def test_overlapped_reductions_leave_the_pipeline_alone_until_the_last():
    """pp 2, ZeRO-2 once a microbatch: the REDUCE_GRAD after each B runs on the lane while the
    rank goes on; the step ends with the last one."""
    plain = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    s = plain.with_sharding(Sharding(2, "per_microbatch"))
    costs = CostModel(forward=F_, backward=B_, reduce_grad=0.1)
    base, r = pipesim.simulate(plain, costs), pipesim.simulate(s, costs)
    t, b = r.trace, base.trace
    for op in ("F", "B"):
        assert (t[t["op"] == op][["rank", "stage", "microbatch", "start", "end"]]
                .reset_index(drop=True).equals(
                    b[b["op"] == op][["rank", "stage", "microbatch", "start", "end"]]
                    .reset_index(drop=True)))
    red = t[t["op"] == "REDUCE_GRAD"]
    bwd = t[t["op"] == "B"]
    assert len(red) == len(bwd) == 8
    ends = dict(zip(zip(bwd["rank"], bwd["microbatch"]), bwd["end"]))
    for row in red.itertuples():
        assert row.start == pytest.approx(ends[(row.rank, row.microbatch)])   # lane was free
    assert r.makespan == pytest.approx(base.makespan + 0.1)


def test_an_unsharded_schedule_ignores_the_sharding_costs():
    s = pipesim.build_schedule("zbv", pp=2, vpp=2, microbatches=4)
    a = pipesim.simulate(s, CostModel(forward=1.0, backward=2.0))
    b = pipesim.simulate(s, CostModel(forward=1.0, backward=2.0, unshard=5.0, reduce_grad=7.0))
    pd.testing.assert_frame_equal(a.trace, b.trace, check_exact=True)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("overlap", [1.0, 0.0])
def test_the_simpy_engine_walks_the_same_rows(name, vpp, overlap):
    s = pipesim.build_schedule(name, pp=2, vpp=vpp, microbatches=4).with_sharding(
        Sharding(3, "per_microbatch"))
    costs = CostModel(forward=1.0, backward=2.0, unshard=0.7, reduce_grad=0.3,
                      overlap_sharding=overlap)
    flow = pipesim.simulate(s, costs)
    other = pipesim.simulate(s, costs, comm="rendezvous")   # free links: the same arrivals
    # (a send's and a receive's spans are the mode's: rendezvous places a send at the post)
    keep = ~flow.trace["op"].isin(["RECV_F", "RECV_B", "SEND_F", "SEND_B"])
    for col in ("start", "end"):
        np.testing.assert_allclose(other.trace[col][keep].to_numpy(),
                                   flow.trace[col][keep].to_numpy())


def test_the_trace_gantt_and_chrome_trace_show_them():
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=2).with_sharding(Sharding(3))
    r = pipesim.simulate(s, CostModel(forward=1.0, backward=2.0, unshard=0.5, reduce_grad=0.25))
    t = r.trace
    ops = set(t["op"].astype(str))
    assert {"UNSHARD", "RESHARD", "REDUCE_GRAD"} <= ops
    shard = t[t["op"].isin(["UNSHARD", "RESHARD", "REDUCE_GRAD"])]
    assert (shard["kind"] == "comm").all() and (shard["peer"] == -1).all()
    assert (shard["bytes"] == 0).all()
    # the op codes of the other rows as before: the plain schedule's categories first
    plain = pipesim.simulate(pipesim.build_schedule("1f1b", pp=2, microbatches=2))
    assert list(plain.trace["op"].cat.categories) == list(t["op"].cat.categories)[:10]
    events = chrome_trace(t)["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "sharding (data-parallel)" in lanes
    pytest.importorskip("matplotlib")
    from pipesim.sim.plot import gantt

    fig = gantt(r)
    labels = [h.get_label() for h in fig.axes[0].get_legend().legend_handles]
    assert "UNSHARD" in labels and "REDUCE_GRAD" in labels


def test_the_cost_models_json_keeps_them_and_unset_writes_nothing_new():
    plain = CostModel(forward=1.0).to_dict()
    assert not {"unshard", "reduce_grad", "overlap_sharding"} & set(plain)
    c = CostModel(forward=1.0, unshard=[0.5, 0.25], reduce_grad=0.1, overlap_sharding=0.0)
    back = CostModel.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c
    with pytest.raises(ValueError, match="overlap_sharding must be 0 or 1"):
        CostModel(overlap_sharding=0.5)


# -- a stage made of units, streamed (FSDP's and Megatron's layer at a time) -------------------
# One rank, F = 1, B = 2, two microbatches: UNSHARD before each of F0 B0 F1 B1, REDUCE_GRAD
# after B1 once a step. A gather of L units lets its computation start on the first unit
# (u / L) and end no sooner than the last unit's share of it (X / L) after the gather ends; a
# reduction of L units starts once its backward made the first unit's gradients (B / L in)
# and ends no sooner than one unit's reduction (r / L) after that backward.

def test_a_streamed_gather_shows_only_its_first_unit():
    u, r, units = 0.5, 0.25, 4
    res = pipesim.simulate(one_rank(), CostModel(forward=F_, backward=B_, unshard=u,
                                                 reduce_grad=r, unshard_units=units))
    assert res.makespan == pytest.approx(u / units + 2 * (F_ + B_) + r)


def test_a_longer_streamed_gather_paces_the_computations_by_their_last_units():
    u, r, units = 3.0, 0.25, 4
    res = pipesim.simulate(one_rank(), CostModel(forward=F_, backward=B_, unshard=u,
                                                 reduce_grad=r, unshard_units=units))
    t = res.trace
    comp = t[t["kind"] == "compute"]
    # gathers back to back on the lane; computation k starts on its first unit, ends its last
    # unit's share after its gather
    assert t[t["op"] == "UNSHARD"]["start"].tolist() == pytest.approx([0.0, u, 2 * u, 3 * u])
    assert comp["start"].tolist() == pytest.approx([k * u + u / units for k in range(4)])
    assert comp["end"].tolist() == pytest.approx(
        [(k + 1) * u + x / units for k, x in enumerate((F_, B_, F_, B_))])
    assert res.makespan == pytest.approx(4 * u + B_ / units + r)


@pytest.mark.parametrize("r", [1.0, 3.0])
def test_a_streamed_reduction_shows_its_last_bucket_or_what_the_backward_cannot_hide(r):
    units = 4
    s = pipesim.build_schedule("1f1b", pp=1, microbatches=2).with_sharding(Sharding(2))
    res = pipesim.simulate(s, CostModel(forward=F_, backward=B_, reduce_grad=r,
                                        reduce_grad_units=units))
    red = res.trace[res.trace["op"] == "REDUCE_GRAD"]
    began = F_ + B_ + F_                                  # the last B's start
    assert red["start"].tolist() == pytest.approx([began + B_ / units])
    assert res.makespan == pytest.approx(max(2 * (F_ + B_) + r / units, began + B_ / units + r))


def test_waited_reductions_end_every_backward():
    """Once a microbatch with ``overlap_reduce_grad`` 0 (DeepSpeed's epilogue, FSDP's
    post-backward callback): the rank goes on only once each backward's reduction is done."""
    r = 0.5
    s = pipesim.build_schedule("1f1b", pp=1, microbatches=2).with_sharding(
        Sharding(2, "per_microbatch"))
    res = pipesim.simulate(s, CostModel(forward=F_, backward=B_, reduce_grad=r,
                                        overlap_reduce_grad=0.0))
    comp = res.trace[res.trace["kind"] == "compute"]
    assert comp["start"].tolist() == pytest.approx([0.0, F_, F_ + B_ + r, 2 * F_ + B_ + r])
    assert res.makespan == pytest.approx(2 * (F_ + B_ + r))
    with pytest.raises(ValueError, match="overlap_reduce_grad must be 0 or 1"):
        CostModel(overlap_reduce_grad=0.5)
    with pytest.raises(ValueError, match="unshard_units must be >= 1"):
        CostModel(unshard_units=[1.0, 0.5])


def test_units_are_ignored_when_the_collectives_block():
    """pipeexec (overlap_sharding 0) gathers and reduces a stage at once, the rank waiting."""
    u, r = 0.5, 0.25
    blocking = CostModel(forward=F_, backward=B_, unshard=u, reduce_grad=r, overlap_sharding=0.0)
    a = pipesim.simulate(one_rank(), blocking)
    b = pipesim.simulate(one_rank(), blocking.with_(unshard_units=4, reduce_grad_units=4))
    pd.testing.assert_frame_equal(a.trace, b.trace, check_exact=True)


def test_a_reduction_once_a_step_leaves_the_ranks_later_computations_alone():
    """Interleaved, ZeRO-2 once a step, long reductions: each stage's REDUCE_GRAD runs on the
    lane after its last backward while the rank computes its other stage; every computation
    where the unsharded schedule has it (Megatron's overlap_grad_reduce)."""
    plain = pipesim.build_schedule("interleaved", pp=2, vpp=2, microbatches=4)
    costs = CostModel(forward=F_, backward=B_, reduce_grad=5.0, reduce_grad_units=4)
    base = pipesim.simulate(plain, costs)
    r = pipesim.simulate(plain.with_sharding(Sharding(2)), costs)
    cols = ["rank", "op", "stage", "microbatch", "start", "end"]
    comp, bcomp = (x.trace[x.trace["kind"] == "compute"][cols].reset_index(drop=True)
                   for x in (r, base))
    pd.testing.assert_frame_equal(comp.astype({"op": str}), bcomp.astype({"op": str}))
    assert r.makespan > base.makespan


@pytest.mark.parametrize("grad_reduce", ["per_step", "per_microbatch"])
def test_the_simpy_engine_walks_streamed_units_the_same(grad_reduce):
    s = pipesim.build_schedule("zbv", pp=2, vpp=2, microbatches=4).with_sharding(
        Sharding(3, grad_reduce))
    costs = CostModel(forward=1.0, backward=2.0, unshard=0.7, reduce_grad=0.9, unshard_units=3,
                      reduce_grad_units=[2, 3, 4, 5],
                      overlap_reduce_grad=0.0 if grad_reduce == "per_microbatch" else 1.0)
    flow = pipesim.simulate(s, costs)
    other = pipesim.simulate(s, costs, comm="rendezvous")
    keep = ~flow.trace["op"].isin(["RECV_F", "RECV_B", "SEND_F", "SEND_B"])
    for col in ("start", "end"):
        np.testing.assert_allclose(other.trace[col][keep].to_numpy(),
                                   flow.trace[col][keep].to_numpy())
