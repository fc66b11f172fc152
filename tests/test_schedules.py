"""Every registered builder: output validates, counts are right, in-flight memory matches theory."""
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pipesim
from pipesim import Action, ScheduleError


def try_build(name, pp, vpp, m, **kw):
    try:
        return pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp, **kw)
    except ScheduleError as exc:
        # A rejection must say which constraint, in words, and name the schedule.
        assert name in str(exc) and ("needs" in str(exc) or "must" in str(exc)), str(exc)
        return None


def peak_inflight(order):
    """Max number of (stage, microbatch) whose forward ran and whose activations are not yet freed."""
    held, peak = set(), 0
    for op, s, mb in order:
        if op == "F":
            held.add((s, mb))
            peak = max(peak, len(held))
        elif op in ("B", "W"):
            held.discard((s, mb))
    return peak


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(pipesim.schedule_names()), pp=st.integers(1, 16),
       vpp=st.integers(1, 4), m=st.integers(1, 64), forward_only=st.booleans())
def test_every_builder_validates_and_counts(name, pp, vpp, m, forward_only):
    s = try_build(name, pp, vpp, m, forward_only=forward_only)
    if s is None:
        return
    s.validate()
    # vpp is model parts per rank; a schedule with copies (dualpipe) holds more stages per rank
    assert (s.pp, s.num_parts, s.num_microbatches) == (pp, pp * vpp, m)
    assert s.num_stages == pp * s.vpp and (s.vpp == vpp or s.has_copies)
    counts = Counter(a.op for r in range(pp) for a in s.compute_parts(r))   # overlaps split
    visits = sum(len(s.route(mb)) for mb in range(m))        # pp * vpp * m without routes
    assert visits == pp * vpp * m                            # every route is the whole model
    assert counts["F"] == visits
    if forward_only:
        assert set(counts) == {"F"}
    else:
        assert counts["B"] + counts["I"] == visits
        assert counts["I"] == counts["W"]
    for r in range(pp):
        assert set(s.rank_stages(r)) == {a.stage for a in s.compute_parts(r)}
        assert all(s.stage_rank(st_) == r for st_ in s.rank_stages(r))
        assert all(not a.is_comm for a in s.compute_order(r))


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 16), m=st.integers(1, 64))
def test_1f1b_and_gpipe_inflight_match_theory(pp, m):
    one = pipesim.build_schedule("1f1b", pp=pp, microbatches=m)
    gp = pipesim.build_schedule("gpipe", pp=pp, microbatches=m)
    for r in range(pp):
        assert peak_inflight(one.compute_order(r)) == min(pp - r, m)
        assert peak_inflight(gp.compute_order(r)) == m


def megatron_1f1b(pp, rank, m):
    """Megatron-LM forward_backward_pipelining_without_interleaving, transcribed as a loop."""
    num_warmup = min(pp - rank - 1, m)
    remaining = m - num_warmup
    out, fwd, bwd = [], 0, 0
    for _ in range(num_warmup):
        out.append(("F", fwd)); fwd += 1
    for i in range(remaining):
        out.append(("F", fwd)); fwd += 1
        out.append(("B", bwd)); bwd += 1
    for _ in range(num_warmup):
        out.append(("B", bwd)); bwd += 1
    return out


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 32])
def test_1f1b_is_megatrons_order(pp, m):
    s = pipesim.build_schedule("1f1b", pp=pp, microbatches=m)
    for r in range(pp):
        assert [(a.op, a.microbatch) for a in s.compute_order(r)] == megatron_1f1b(pp, r, m)
        assert {a.stage for a in s.compute_order(r)} == {r}


def test_gpipe_order():
    s = pipesim.build_schedule("gpipe", pp=2, microbatches=3)
    assert [str(a) for a in s.compute_order(1)] == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_looped_bfs_order():
    s = pipesim.build_schedule("looped-bfs", pp=2, microbatches=2, vpp=2)
    assert [str(a) for a in s.compute_order(0)] == ["0F0", "0F1", "2F0", "2F1", "2B1", "2B0", "0B1", "0B0"]
    assert s.rank_stages(1) == [1, 3] and s.stage_chunk(3) == 1


def test_comms_inserted_next_to_compute():
    s = pipesim.build_schedule("1f1b", pp=3, microbatches=2)
    assert [str(a) for a in s.actions(1)] == [
        "1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1",
        "1RECV_B0", "1B0", "1SEND_B0", "1RECV_B1", "1B1", "1SEND_B1"]
    assert [str(a) for a in s.actions(0)][:3] == ["0F0", "0SEND_F0", "0F1"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(pipesim.schedule_names()), pp=st.integers(2, 6),
       vpp=st.integers(1, 3), m=st.integers(1, 12), lookahead=st.integers(1, 4))
def test_receives_posted_ahead(name, pp, vpp, m, lookahead):
    base = try_build(name, pp, vpp, m)
    if base is None:
        return
    s = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp, recv_lookahead=lookahead)
    assert s == base.with_recv_lookahead(lookahead) and s.recv_lookahead == lookahead
    assert pipesim.schedule_from_json(pipesim.schedule_to_json(s)) == s
    s.validate()
    for rank in range(pp):
        late, early = base.actions(rank), s.actions(rank)
        # the same computations in the same order, the same sends right after their producers
        assert [a for a in early if a.op not in ("RECV_F", "RECV_B")] == \
            [a for a in late if a.op not in ("RECV_F", "RECV_B")]
        recvs = [a for a in late if a.op in ("RECV_F", "RECV_B")]
        assert sorted(a for a in early if a.op in ("RECV_F", "RECV_B")) == sorted(recvs)
        compute = [i for i, a in enumerate(early) if a.is_compute]
        at = {p: i for i, a in enumerate(early) if a.is_compute for p in a.parts}  # overlaps
        channel_order = {}
        for i, a in enumerate(early):
            if a.op not in ("RECV_F", "RECV_B"):
                continue
            consumer = at[Action("F" if a.op == "RECV_F" else next(
                op for op in ("B", "I") if Action(op, a.stage, a.microbatch) in at),
                a.stage, a.microbatch)]
            between = sum(1 for c in compute if i < c < consumer)
            made = at[Action("F", a.stage, a.microbatch)] if a.op == "RECV_B" else -1
            # at most `lookahead` computations ahead of the consumer, never above the forward
            # whose output shape the gradient buffer takes; as many as allowed otherwise
            assert i > made and between <= lookahead, (rank, a)
            peer = s.stage_rank(a.stage - 1 if a.op == "RECV_F" else a.stage + 1)
            channel_order.setdefault((a.op, peer), []).append(consumer)
        for consumers in channel_order.values():   # each channel keeps its consumers' order
            assert consumers == sorted(consumers)


def test_receive_lookahead_by_hand():
    s = pipesim.build_schedule("1f1b", pp=3, microbatches=3, recv_lookahead=1)
    assert [str(a) for a in s.actions(1)] == [
        # compute order F0 F1 B0 F2 B1 B2; B0's gradient receive waits for F0 to have run
        "1RECV_F0", "1RECV_F1", "1F0", "1SEND_F0", "1RECV_B0", "1F1", "1SEND_F1",
        "1RECV_F2", "1B0", "1SEND_B0", "1RECV_B1", "1F2", "1SEND_F2", "1RECV_B2", "1B1",
        "1SEND_B1", "1B2", "1SEND_B2"]
    assert "recv_lookahead=1" in repr(s)
    with pytest.raises(ScheduleError, match="recv_lookahead"):
        pipesim.build_schedule("1f1b", pp=2, microbatches=2, recv_lookahead=-1)


def test_no_comms_between_stages_on_the_same_rank():
    # V placement: stages 1 and 2 both on rank 1 for pp=2.
    orders = [[Action("F", 0, 0), Action("F", 3, 0), Action("B", 3, 0), Action("B", 0, 0)],
              [Action("F", 1, 0), Action("F", 2, 0), Action("B", 2, 0), Action("B", 1, 0)]]
    s = pipesim.Schedule(2, 2, 1, "v", orders).validate()
    assert [str(a) for a in s.actions(1)] == [
        "1RECV_F0", "1F0", "2F0", "2SEND_F0", "2RECV_B0", "2B0", "1B0", "1SEND_B0"]
    assert s.placement == (0, 1, 1, 0)


def test_schedule_equality_repr_and_hash():
    a = pipesim.build_schedule("1f1b", pp=4, microbatches=8)
    b = pipesim.build_schedule("1f1b", pp=4, microbatches=8)
    c = pipesim.build_schedule("gpipe", pp=4, microbatches=8)
    assert a == b and hash(a) == hash(b) and a != c
    assert "1f1b" in repr(a) and "rank 3: 3F0 3B0" in repr(a)


def test_large_schedule_is_cheap_to_build():
    s = pipesim.build_schedule("looped-bfs", pp=64, vpp=4, microbatches=1024)
    assert s.num_compute_actions == 2 * 64 * 4 * 1024
    # every F and B of a middle rank has a RECV before it and a SEND after it
    assert len(s.actions(5)) == 4 * 1024 * 2 * 3


def test_unknown_schedule_and_bad_parameters():
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'"):
        pipesim.build_schedule("nope", pp=2, microbatches=2)
    with pytest.raises(ScheduleError, match="pp must be a positive integer"):
        pipesim.build_schedule("1f1b", pp=0, microbatches=2)
    with pytest.raises(ScheduleError, match="gpipe needs vpp == 1"):
        pipesim.build_schedule("gpipe", pp=2, microbatches=2, vpp=2)
