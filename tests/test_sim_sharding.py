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
