"""The bubble metrics on non-uniform stages, against an independent computation from the
trace's rows: with unequal stages the ranks are unequally busy, so "the busiest rank" (Megatron's
bubble_fraction) and "the slowest rank" (Zero Bubble's bubble_rate) are not any rank, nor the
mean: a metric that averaged over ranks would fail here (on uniform stages it would not)."""
from __future__ import annotations

import pytest

import pipesim

COSTS = pipesim.CostModel(forward=[1.0, 2.5, 1.5, 0.7], backward_input=[1.2, 3.0, 2.0, 0.8],
                          backward_weight=[0.9, 2.2, 1.4, 0.5])


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1"])
def test_bubble_fraction_is_the_busiest_ranks_and_bubble_rate_the_slowest_ranks(name):
    r = pipesim.simulate(pipesim.build_schedule(name, pp=4, microbatches=8), COSTS)
    rows = r.trace[r.trace["kind"] == "compute"]
    makespan = float(r.trace["end"].max() - r.trace["start"].min())
    busy = {k: float((g["end"] - g["start"]).sum()) for k, g in rows.groupby("rank")}
    span = {k: float(g["end"].max() - g["start"].min()) for k, g in rows.groupby("rank")}
    assert len(set(round(b, 9) for b in busy.values())) == 4      # really non-uniform

    busiest = max(busy.values())
    assert r.bubble_fraction == pytest.approx((makespan - busiest) / busiest, rel=1e-12)
    mean = sum(busy.values()) / 4
    assert abs((makespan - mean) / mean - r.bubble_fraction) > 0.05   # the mean is not it

    idle_share = {k: 1 - busy[k] / span[k] for k in busy}
    slowest = max(idle_share, key=idle_share.get)
    assert r.slowest_rank == slowest
    assert r.bubble_rate == pytest.approx(idle_share[slowest], rel=1e-12)
    assert r.bubble_rate > sum(idle_share.values()) / 4 + 0.01
