"""The memory model and in-flight counts, against hand-worked timelines and closed forms."""
import pytest
from hypothesis import given, settings, strategies as st

import pipesim
from pipesim import Action, CostModel, Schedule, SimResult, simulate


def one_rank(order_text):
    order = [Action.parse(t) for t in order_text.split()]
    return Schedule(1, 1, 2, "looped", [order], name="hand")


@pytest.mark.parametrize("order,expected,peak", [
    # F adds at start; I frees 1 - 0.25 at its end; W frees the 0.25 W needs.
    ("0F0 0F1 0I0 0I1 0W0 0W1", [1, 2, 1.25, 0.5, 0.25, 0.0], 2.0),
    ("0F0 0I0 0F1 0W0 0I1 0W1", [1, 0.25, 1.25, 1.0, 0.25, 0.0], 1.25),
    ("0F0 0B0 0F1 0B1", [1, 0, 1, 0], 1.0),
])
def test_hand_timelines(order, expected, peak):
    r = simulate(one_rank(order), CostModel(activation_bytes=1.0, weight_grad_fraction=0.25,
                                            static_bytes=10.0))
    tl = r.memory_timeline
    assert list(tl["bytes"]) == pytest.approx([10.0] + [10.0 + x for x in expected])
    assert r.peak_memory == [10.0 + peak]


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 3), (4, 8), (5, 12)])
def test_1f1b_peak_memory_closed_form(pp, m):
    act = [float(10 + s) for s in range(pp)]
    costs = CostModel(forward=[1.0 + 0.1 * s for s in range(pp)], activation_bytes=act,
                      static_bytes=[100.0 * r for r in range(pp)], stage_static_bytes=7.0)
    r = simulate(pipesim.build_schedule("1f1b", pp=pp, microbatches=m), costs)
    assert r.peak_memory == pytest.approx([100.0 * k + 7.0 + min(pp - k, m) * act[k] for k in range(pp)])
    g = simulate(pipesim.build_schedule("gpipe", pp=pp, microbatches=m), costs)
    assert g.peak_memory == pytest.approx([100.0 * k + 7.0 + m * act[k] for k in range(pp)])


def test_interleaved_inflight_matches_megatron_warmup():
    # Megatron-LM interleaved: rank r runs (pp - r - 1) * 2 + (vpp - 1) * pp warm-up forwards,
    # then one more before its first backward.
    pp, vpp, m = 4, 2, 8
    r = simulate(pipesim.build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m),
                 CostModel.uniform())
    assert r.peak_inflight == [(pp - k - 1) * 2 + (vpp - 1) * pp + 1 for k in range(pp)]
    # Stage static bytes land on the rank that holds the stage (2 chunks per rank).
    r2 = simulate(r.schedule, CostModel.uniform(activation_bytes=0.0,
                                                stage_static_bytes=[float(s) for s in range(8)]))
    assert r2.peak_memory == [0 + 4, 1 + 5, 2 + 6, 3 + 7]


def test_forward_only_frees_after_each_forward():
    s = pipesim.build_schedule("1f1b", pp=3, microbatches=4, forward_only=True)
    r = simulate(s, CostModel(activation_bytes=5.0, static_bytes=1.0))
    assert r.peak_inflight == [1, 1, 1]
    assert r.peak_memory == [6.0, 6.0, 6.0]


def test_measured_memory_timeline_is_used():
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    tr = simulate(s, CostModel.uniform()).trace
    import pandas as pd
    timeline = pd.DataFrame({"rank": [0, 0, 1], "time": [0.0, 1.0, 0.5], "bytes": [3.0, 9.0, 4.0]})
    r = SimResult.from_trace(tr, memory_timeline=timeline)
    assert r.peak_memory == [9.0, 4.0]
    with pytest.raises(ValueError, match="memory needs a memory_timeline or a CostModel"):
        SimResult.from_trace(tr).peak_memory
    with pytest.raises(ValueError, match="memory_timeline is missing column"):
        SimResult.from_trace(tr, memory_timeline=timeline.drop(columns="bytes"))
    # The model replayed over a trace alone gives the simulation's peaks.
    costs = CostModel.uniform(activation_bytes=2.0)
    assert SimResult.from_trace(tr, costs=costs).peak_memory == simulate(s, costs).peak_memory


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(pipesim.schedule_names()), pp=st.integers(1, 4), m=st.integers(1, 6),
       vpp=st.integers(1, 2), frac=st.floats(0.0, 1.0))
def test_memory_model_agrees_with_inflight_count(name, pp, m, vpp, frac):
    """Two separately coded replays: with W needing nothing, bytes held == pairs in flight."""
    schedule = None
    for v in (vpp, 1, 2):
        try:
            schedule = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=v)
            break
        except pipesim.ScheduleError:
            continue
    if schedule is None:
        return
    r = simulate(schedule, CostModel.uniform(activation_bytes=1.0, weight_grad_fraction=0.0))
    assert r.peak_memory == [float(k) for k in r.peak_inflight]
    # Whatever W keeps, everything is freed by the end of the step: back to static bytes.
    r2 = simulate(schedule, CostModel.uniform(activation_bytes=3.0, weight_grad_fraction=frac,
                                              static_bytes=2.0))
    last = r2.memory_timeline.groupby("rank")["bytes"].last()
    assert list(last) == pytest.approx([2.0] * schedule.pp, abs=1e-9)


def test_receive_buffers_held_from_posting():
    # 1F1B, pp = 2, m = 2, F = 1, B = 2, free transfers of 1-byte messages, 10 bytes of
    # activations per (stage, microbatch). A gradient's buffer is held from its posting to the
    # end of its B; an activation's buffer adds only while posted ahead of its F.
    costs = CostModel(forward=1.0, backward=2.0, activation_bytes=10.0, p2p_bytes=1.0)
    late = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    early = late.with_recv_lookahead(1)
    assert simulate(late, costs).peak_memory == [21.0, 10.0]     # rank 0: B0 holds its gradient
    # rank 0 posts RECV_B0 before F1 and RECV_B1 before B0: 10 + 1 + 10 + 1 at B0's start;
    # rank 1 posts RECV_F1 before B0: 10 + 1 while B0 runs
    assert simulate(early, costs).peak_memory == [22.0, 11.0]
    tl = simulate(early, costs).memory_timeline
    assert list(tl[tl["rank"] == 1]["bytes"]) == [0.0, 10.0, 11.0, 1.0, 0.0, 10.0, 0.0]
    assert simulate(early, costs.with_(p2p_bytes=0.0)).peak_memory == [20.0, 10.0]


def test_an_output_is_held_while_its_forward_runs_until_sent():
    # A = 100 bytes of activations per (stage, microbatch), P = 10-byte messages. 1F1B, pp 2,
    # m 4: rank 0 holds 2 microbatches and, during its second F, that F's output (2A + P);
    # rank 1 (the last stage) sends no activation: A. ZB-V, pp 2: at the peak, 4A plus the
    # output of the F running then on rank 0 (stage 0's, sent); rank 1, the V's turn, holds
    # 4A during F(1, 2) plus what its two stages hand each other: that F's output (for
    # F(2, 2)) and I(2, 0)'s input gradient (for I(1, 0)), nothing sent.
    costs = CostModel(forward=1.0, backward=2.0, activation_bytes=100.0, p2p_bytes=10.0)
    one = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    assert simulate(one, costs).peak_memory == [210.0, 100.0]
    assert simulate(one, costs.with_(p2p_bytes=0.0)).peak_memory == [200.0, 100.0]
    zbv = pipesim.build_schedule("zbv", pp=2, microbatches=4, vpp=2)
    assert simulate(zbv, costs).peak_memory == [410.0, 420.0]


def test_a_routes_last_stage_holds_no_output_to_send():
    # A hand-made routed schedule (pipesim.Schedule routes): pp 2, looped vpp 2, microbatch 0
    # through stages 0-1, microbatch 1 through stages 2-3 (copies of parts 0-1). Stage 1 is
    # the end of microbatch 0's route, although stage 2 sits on another rank: its F sends
    # nothing, so rank 1 holds A alone; rank 0 holds 2A plus F(2,1)'s output on its way to 3.
    from pipesim.schedule.action import Action as A

    orders = [[A("F", 0, 0), A("F", 2, 1), A("B", 0, 0), A("B", 2, 1)],
              [A("F", 1, 0), A("B", 1, 0), A("F", 3, 1), A("B", 3, 1)]]
    routed = pipesim.Schedule(2, 2, 2, "looped", orders, name="two routes",
                              routes=[(0, 1), (2, 3)], stage_parts=(0, 1, 0, 1),
                              recv_lookahead=0).validate()
    costs = CostModel(forward=1.0, backward=2.0, activation_bytes=100.0, p2p_bytes=10.0)
    assert simulate(routed, costs).peak_memory == [210.0, 100.0]
