"""The engine against an independent list scheduler, plus its modes and its errors."""
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

import pipesim
from pipesim import Action, CostModel, ScheduleError, simulate

NAMES = pipesim.schedule_names()


def list_schedule(schedule, costs, blocking=False):
    """Start time of every compute action, by plain list scheduling over the compute orders.

    Independent of the engine: no SimPy, no SEND/RECV actions. Each compute action starts when
    its rank is free and its input is there: the previous stage's F (forward) or the next
    stage's B/I (backward), directly on the same rank or after a transfer on the directed link
    between the two ranks, which carries one message at a time in the order they are produced.
    A microbatch's chain starts and ends at its route's first and last stage (dualpipe).
    """
    n, pp = schedule.num_stages, schedule.pp
    place = schedule.placement
    t = costs.compute_times(n)
    nbytes = costs.stage_values("p2p_bytes", n)
    order = [schedule.compute_order(r) for r in range(pp)]
    pos = [0] * pp
    free = [0.0] * pp
    end = {}       # ("F"|"G", stage, mb) -> end time of the compute
    arrive = {}    # ("F"|"G", receiving stage, mb) -> arrival time
    link = {}
    start = {}
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(order[r]):
                # An OVERLAP_F_B runs its parts back to back in overlap_factor x their time and
                # sends their outputs at its end; it starts when the inputs of both are there
                # (factor != 1: they run together), or each part when its own is (factor 1).
                parts = order[r][pos[r]].parts
                readies = []
                for op, s, mb in parts:
                    if op == "F":
                        if s == schedule.first_stage(mb):
                            ready = 0.0
                        elif place[s - 1] == r:
                            ready = end[("F", s - 1, mb)]
                        else:
                            ready = arrive.get(("F", s, mb))
                    elif op in ("B", "I"):
                        if s == schedule.last_stage(mb):
                            ready = 0.0
                        elif place[s + 1] == r:
                            ready = end[("G", s + 1, mb)]
                        else:
                            ready = arrive.get(("G", s, mb))
                    else:
                        ready = 0.0
                    readies.append(ready)
                if None in readies:
                    break
                scale = costs.overlap_factor if len(parts) > 1 else 1.0
                # run together (overlap_factor != 1): both inputs first; in turn: each its own
                together = len(parts) > 1 and costs.overlaps_parts
                finish = max([free[r]] + readies) if together else free[r]
                for (op, s, mb), ready in zip(parts, readies):
                    if not together:
                        finish = max(finish, ready)
                    start[(r, op, s, mb)] = finish
                    finish += t[op][s] * scale
                free[r] = finish
                for op, s, mb in parts:
                    key = "F" if op == "F" else "G"
                    end[(key, s, mb)] = finish
                    dest = s + 1 if op == "F" else s - 1
                    if op != "W" and dest in schedule.route(mb) and place[dest] != r:
                        size = nbytes[min(s, dest)]
                        lk = (r, place[dest])
                        go = max(finish, link.get(lk, 0.0))
                        done = go + costs.p2p_latency + (size / costs.p2p_bandwidth if size else 0.0)
                        link[lk] = done
                        arrive[(key, dest, mb)] = done
                        if blocking:
                            free[r] = finish = done
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(order[r]) for r in range(pp)), "list scheduler got stuck"
    return start


def build_any(name, pp, m, vpp, forward_only=False):
    """The schedule for the first vpp (of vpp, 1, 2, 3) the builder accepts, with m
    microbatches or, for builders that need more (dualpipev: 2 pp), that many."""
    for mm in dict.fromkeys((m, max(m, 2 * pp), max(m + m % 2, 2 * pp))):
        for v in (vpp, 1, 2, 3):
            try:
                return pipesim.build_schedule(name, pp=pp, microbatches=mm, vpp=v,
                                              forward_only=forward_only)
            except ScheduleError:
                continue
    if name == "dualpipe" and pp % 2:
        return build_any(name, pp + 1, m, vpp, forward_only)   # its pp must be even
    raise AssertionError(f"{name} accepts no vpp in 1..3 for pp={pp}, m={m} or {2 * pp}")


def starts_of(result):
    rows = result.trace[result.trace["kind"] == "compute"]
    return {(int(r.rank), str(r.op), int(r.stage), int(r.microbatch)): float(r.start)
            for r in rows.itertuples(index=False)}


def stage_costs(n):
    pos = st.floats(0.05, 5.0, allow_nan=False, allow_infinity=False)
    return st.tuples(st.lists(pos, min_size=n, max_size=n), st.lists(pos, min_size=n, max_size=n),
                     st.lists(pos, min_size=n, max_size=n))


def draw_costs(data, n, comm):
    """Random per-stage F/I/W and one of three communication settings ("none", "latency", "bandwidth")."""
    f, i, w = data.draw(stage_costs(n))
    extra = {}
    if comm == "latency":
        extra = dict(p2p_latency=data.draw(st.floats(0.0, 3.0)))
    elif comm == "bandwidth":
        extra = dict(p2p_latency=0.1, p2p_bandwidth=10.0,
                     p2p_bytes=data.draw(st.lists(st.floats(0.0, 40.0), min_size=n, max_size=n)))
    overlap = data.draw(st.sampled_from([1.0, 0.5, 0.8]))
    return CostModel(forward=f, backward_input=i, backward_weight=w, overlap_factor=overlap, **extra)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), name=st.sampled_from(NAMES), pp=st.integers(1, 5), m=st.integers(1, 12),
       vpp=st.integers(1, 3), comm=st.sampled_from(["none", "latency", "bandwidth"]),
       blocking=st.booleans(), forward_only=st.sampled_from([False, False, False, True]))
def test_start_times_match_list_scheduler(data, name, pp, m, vpp, comm, blocking, forward_only):
    schedule = build_any(name, pp, m, vpp, forward_only)
    costs = draw_costs(data, schedule.num_stages, comm)
    result = simulate(schedule, costs, comm="blocking" if blocking else "async")
    expected = list_schedule(schedule, costs, blocking=blocking)
    got = starts_of(result)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-9), key


def test_transfer_rows_and_link_fifo():
    # 2 ranks, F = 1, a transfer of 3 s: the link is the bottleneck, messages queue in order.
    s = pipesim.build_schedule("gpipe", pp=2, microbatches=3)
    costs = CostModel(forward=1.0, backward=1.0, p2p_latency=3.0)
    tr = simulate(s, costs).trace
    sends = tr[(tr["op"] == "SEND_F")].sort_values("microbatch")
    assert list(sends["start"]) == [1.0, 4.0, 7.0]
    assert list(sends["end"]) == [4.0, 7.0, 10.0]
    assert set(sends["peer"]) == {1}
    f1 = tr[(tr["op"] == "F") & (tr["rank"] == 1)].sort_values("microbatch")
    assert list(f1["start"]) == [4.0, 7.0, 10.0]
    recv = tr[(tr["op"] == "RECV_F")].sort_values("microbatch")
    assert list(recv["end"] - recv["start"]) == [4.0, 2.0, 2.0]   # waits of rank 1


def test_blocking_sender_waits():
    s = pipesim.build_schedule("gpipe", pp=2, microbatches=2)
    costs = CostModel(forward=1.0, backward=1.0, p2p_latency=3.0)
    tr = simulate(s, costs, comm="blocking").trace
    f0 = tr[(tr["op"] == "F") & (tr["rank"] == 0)].sort_values("microbatch")
    assert list(f0["start"]) == [0.0, 4.0]          # the second F waits for the first transfer
    tr_async = simulate(s, costs).trace
    f0 = tr_async[(tr_async["op"] == "F") & (tr_async["rank"] == 0)].sort_values("microbatch")
    assert list(f0["start"]) == [0.0, 1.0]


def test_step_tail_ring_allreduce_and_optimizer():
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    costs = CostModel(forward=1.0, backward=2.0, grad_bytes=[100.0, 300.0], optimizer=[0.5, 0.25],
                      dp_latency=0.01, dp_bandwidth=50.0)
    base = simulate(s, costs)
    r = simulate(s, costs, step_tail=True, dp=4)
    tail = r.trace[r.trace["stage"] < 0]
    for rank, grad, opt in ((0, 100.0, 0.5), (1, 300.0, 0.25)):
        rows = tail[tail["rank"] == rank].set_index("op")
        last = base.trace[base.trace["rank"] == rank]["end"].max()
        ring = 2 * 3 * 0.01 + 2 * 3 / 4 * grad / 50.0
        assert rows.loc["ALLREDUCE", "start"] == pytest.approx(last)
        assert rows.loc["ALLREDUCE", "end"] - rows.loc["ALLREDUCE", "start"] == pytest.approx(ring)
        assert rows.loc["OPTIMIZER", "end"] - rows.loc["OPTIMIZER", "start"] == pytest.approx(opt)
        assert rows.loc["ALLREDUCE", "kind"] == "comm" and rows.loc["OPTIMIZER", "kind"] == "compute"
    assert r.makespan == pytest.approx(max(tail["end"]))
    # dp = 1: no all-reduce time, only the optimizer.
    one = simulate(s, costs, step_tail=True, dp=1).trace
    ar = one[one["op"] == "ALLREDUCE"]
    assert (ar["end"] == ar["start"]).all()


def test_jitter_is_seeded_and_bounded():
    s = pipesim.build_schedule("1f1b", pp=3, microbatches=6)
    costs = CostModel.uniform(1.0, 2.0)
    a = simulate(s, costs, jitter=0.2, seed=7).trace
    b = simulate(s, costs, jitter=0.2, seed=7).trace
    c = simulate(s, costs, jitter=0.2, seed=8).trace
    assert a.equals(b)
    assert not a["end"].equals(c["end"])
    comp = a[a["kind"] == "compute"]
    nominal = comp["op"].map({"F": 1.0, "B": 2.0}).astype(float)
    ratio = (comp["end"] - comp["start"]) / nominal
    assert ratio.between(0.8, 1.2).all() and ratio.std() > 0.01


def test_trace_columns_and_every_action_once():
    s = pipesim.build_schedule("interleaved", pp=2, vpp=2, microbatches=4)
    tr = simulate(s, CostModel.uniform()).trace
    assert list(tr.columns) == ["rank", "op", "stage", "chunk", "microbatch", "start", "end",
                                "kind", "bytes", "peer"]
    assert len(tr) == sum(len(s.actions(r)) for r in range(s.pp))
    for r in range(s.pp):
        rows = tr[tr["rank"] == r]
        assert [str(o) for o in rows["op"]] == [a.op for a in s.actions(r)]
        assert list(rows["chunk"]) == [s.stage_chunk(a.stage) for a in s.actions(r)]
    comp = tr[tr["kind"] == "compute"]
    assert (comp["peer"] == -1).all()
    comm = tr[tr["kind"] == "comm"]
    assert set(comm["op"].astype(str)) == {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}


def test_errors_name_the_field():
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(ValueError, match=r"CostModel.forward has 3 per-stage values, expected num_stages = 2"):
        simulate(s, CostModel(forward=[1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="comm must be one of"):
        simulate(s, CostModel(), comm="eager")
    with pytest.raises(ValueError, match="jitter"):
        simulate(s, CostModel(), jitter=1.5)
    bad = pipesim.Schedule(2, 1, 1, "looped", [[pipesim.Action("F", 0, 0)], []])
    with pytest.raises(ScheduleError):
        simulate(bad, CostModel())


def test_no_torch_import():
    code = ("import sys, pipesim\n"
            "s = pipesim.build_schedule('1f1b', pp=2, microbatches=2)\n"
            "r = pipesim.simulate(s, pipesim.CostModel.uniform())\n"
            "r.summary(); r.to_chrome_trace()\n"
            "assert 'torch' not in sys.modules, 'pipesim imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hand_computed_makespan_with_latency():
    s = pipesim.build_schedule("gpipe", pp=3, microbatches=2)
    r = simulate(s, CostModel(forward=1.0, backward=1.0, p2p_latency=0.5))
    # By hand: rank 1 runs F0 1.5-2.5, F1 2.5-3.5; rank 2 F0 3-4, F1 4-5, B0 5-6, B1 6-7;
    # rank 1 B0 6.5-7.5, B1 7.5-8.5; rank 0 B0 8-9, B1 9-10.
    assert r.makespan == pytest.approx(10.0)
    assert starts_of(r)[(1, "B", 1, 1)] == pytest.approx(7.5)
    assert math.isclose(r.busy[0], 4.0)


# -- rendezvous: a transfer starts once the receiver has posted its receive --------------------------
def rendezvous_reference(schedule, costs):
    """Start time of every compute action, and the arrival of every message, in the rendezvous
    model, by a plain time-ordered event loop (a heap; no SimPy, no local clocks).

    Independent of the engine's run-ahead: each rank walks ``schedule.actions(rank)``, one
    compute per event; a SEND or a RECV notes when it was posted; when the second of the two is
    posted the transfer is ready, and at that moment it takes its directed link (``latency +
    bytes / bandwidth``, after the link's previous transfer); the compute that needs a received
    message blocks the rank until it has arrived (the RECV itself only posts).
    """
    import heapq

    n, pp = schedule.num_stages, schedule.pp
    place = schedule.placement
    t = costs.compute_times(n)
    nbytes = costs.stage_values("p2p_bytes", n)
    acts = [schedule.actions(r) for r in range(pp)]
    idx = [0] * pp
    sub = [0] * pp                    # the part of an overlap run in turn that comes next
    blocked = {}                      # msg -> rank waiting on it
    send_post, recv_post, arrival, link_free = {}, {}, {}, {}
    info = {}                         # msg -> (link, seconds)
    start = {}
    heap, seq = [], [0]

    def push(time, kind, data):
        seq[0] += 1
        heapq.heappush(heap, (time, seq[0], kind, data))

    def run(r, now):
        while idx[r] < len(acts[r]):
            action = acts[r][idx[r]]
            op, s, mb = action
            if action.is_compute:
                # An OVERLAP_F_B whose parts run together waits for both inputs first; one
                # that runs them in turn (factor 1) is one part per event, each waiting its own.
                parts = action.parts
                together = len(parts) > 1 and costs.overlaps_parts
                todo = parts if together else parts[sub[r]:sub[r] + 1]
                for op, s, mb in todo:
                    need = ("F", s, mb) if op == "F" else ("G", s, mb)
                    if op != "W" and need in recv_post and need not in arrival:
                        blocked[need] = r     # waits here; runs again on arrival
                        return
                scale = costs.overlap_factor if len(parts) > 1 else 1.0
                for op, s, mb in todo:
                    start[(r, op, s, mb)] = now
                    now += t[op][s] * scale
                if not together and sub[r] + 1 < len(parts):
                    sub[r] += 1
                else:
                    sub[r] = 0
                    idx[r] += 1
                push(now, "run", r)
                return
            if op in ("SEND_F", "SEND_B"):
                dest = s + 1 if op == "SEND_F" else s - 1
                msg = ("F" if op == "SEND_F" else "G", dest, mb)
                info[msg] = ((r, place[dest]), costs.transfer_time(nbytes[min(s, dest)]))
                send_post[msg] = now
                if msg in recv_post:
                    push(now, "ready", msg)
            else:
                msg = ("F" if op == "RECV_F" else "G", s, mb)
                recv_post[msg] = now
                if msg in send_post:
                    push(now, "ready", msg)
            idx[r] += 1

    for r in range(pp):
        push(0.0, "run", r)
    while heap:
        now, _, kind, data = heapq.heappop(heap)
        if kind == "run":
            run(data, now)
        elif kind == "ready":
            link, c = info[data]
            begin = max(now, link_free.get(link, 0.0))
            link_free[link] = begin + c
            push(begin + c, "arrive", data)
        else:
            arrival[data] = now
            if data in blocked:
                push(now, "run", blocked.pop(data))
    assert all(idx[r] == len(acts[r]) for r in range(pp)) and not blocked, "reference got stuck"
    return start, arrival


@settings(max_examples=80, deadline=None)
@given(data=st.data(), name=st.sampled_from(NAMES), pp=st.integers(1, 5), m=st.integers(1, 8),
       vpp=st.integers(1, 3), comm=st.sampled_from(["none", "latency", "bandwidth"]),
       lookahead=st.integers(0, 3))
def test_rendezvous_matches_event_loop_reference(data, name, pp, m, vpp, comm, lookahead):
    schedule = build_any(name, pp, m, vpp).with_recv_lookahead(lookahead)
    costs = draw_costs(data, schedule.num_stages, comm)
    result = simulate(schedule, costs, comm="rendezvous")
    expected, arrival = rendezvous_reference(schedule, costs)
    got = starts_of(result)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-9), key
    tr = result.trace
    sends = tr[tr["op"].isin(["SEND_F", "SEND_B"])]
    for row in sends.itertuples(index=False):
        dest = row.stage + 1 if row.op == "SEND_F" else row.stage - 1
        msg = ("F" if row.op == "SEND_F" else "G", dest, row.microbatch)
        assert row.end == pytest.approx(arrival[msg], rel=1e-12, abs=1e-9), msg


def test_rendezvous_by_hand():
    # 1F1B, pp = 2, m = 2, F = 1, B = 2, transfers of 0.5 s. Rank 1 posts RECV_F1 only after
    # its B0 (at 4.5): F1, sent at 2, moves 4.5-5.0 instead of 2.0-2.5, and everything after
    # shifts by the transfer; rank 0 posts RECV_B1 at 7, before B1's send at 8: no extra wait.
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    costs = CostModel(forward=1.0, backward=2.0, p2p_latency=0.5)
    r = simulate(s, costs, comm="rendezvous")
    starts = starts_of(r)
    assert starts[(1, "F", 1, 1)] == pytest.approx(5.0)
    assert starts[(0, "B", 0, 1)] == pytest.approx(8.5)
    assert r.makespan == pytest.approx(10.5)
    assert simulate(s, costs).makespan == pytest.approx(10.0)      # async: F1 was there at 2.5
    tr = r.trace
    f1 = tr[(tr["op"] == "SEND_F") & (tr["microbatch"] == 1)].iloc[0]
    assert (f1["start"], f1["end"]) == pytest.approx((4.5, 5.0))
    recv = tr[(tr["op"] == "RECV_F") & (tr["microbatch"] == 1)].iloc[0]
    assert (recv["start"], recv["end"]) == pytest.approx((4.5, 5.0))
    # Free transfers: the moment of posting no longer matters.
    free = CostModel(forward=1.0, backward=2.0)
    assert simulate(s, free, comm="rendezvous").makespan == simulate(s, free).makespan


def test_rendezvous_receive_posted_early_by_hand():
    # The same 1F1B with receives posted one computation early: rank 1 posts RECV_F1 before
    # B0 (at 2.5), so F1 moves 2.5-3.0 while B0 runs, and the step takes the async 10 s.
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=2, recv_lookahead=1)
    assert [str(a) for a in s.actions(1)] == ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0",
                                              "1F1", "1B1", "1SEND_B1"]
    # rank 0: a gradient's receive never goes above the forward of its microbatch
    assert [str(a) for a in s.actions(0)] == ["0F0", "0SEND_F0", "0RECV_B0", "0F1", "0SEND_F1",
                                              "0RECV_B1", "0B0", "0B1"]
    costs = CostModel(forward=1.0, backward=2.0, p2p_latency=0.5)
    r = simulate(s, costs, comm="rendezvous")
    assert starts_of(r)[(1, "F", 1, 1)] == pytest.approx(4.5)
    assert r.makespan == pytest.approx(10.0) == simulate(s, costs).makespan
    tr = r.trace
    f1 = tr[(tr["op"] == "SEND_F") & (tr["microbatch"] == 1)].iloc[0]
    assert (f1["start"], f1["end"]) == pytest.approx((2.5, 3.0))
    # the RECV row spans the consumer's wait: none here (F1 at 4.5, data there at 3.0)
    recv = tr[(tr["op"] == "RECV_F") & (tr["microbatch"] == 1)].iloc[0]
    assert (recv["start"], recv["end"]) == pytest.approx((4.5, 4.5))
    # rank 0's B1 waits 7.0 -> 8.0 for the gradient sent at 7.5
    recv_b = tr[(tr["op"] == "RECV_B") & (tr["microbatch"] == 1)].iloc[0]
    assert (recv_b["start"], recv_b["end"]) == pytest.approx((7.0, 8.0))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(NAMES), pp=st.integers(2, 5), m=st.integers(1, 8),
       vpp=st.integers(1, 3))
def test_receives_posted_far_enough_ahead_make_rendezvous_async(data, name, pp, m, vpp):
    # Posting every receive before any computation it could overlap removes the rendezvous
    # delay entirely: the async model (receives pre-posted) is then exact.
    schedule = build_any(name, pp, m, vpp)
    costs = draw_costs(data, schedule.num_stages, "bandwidth")
    early = schedule.with_recv_lookahead(10 ** 6)
    assert simulate(early, costs, comm="rendezvous").makespan == pytest.approx(
        simulate(schedule, costs).makespan, rel=1e-12)
    # (Posting earlier is not monotone in general: a directed link serves transfers in the
    # order they become ready, and a different order can lengthen a V schedule's step.)


def test_hand_written_early_receive_waits_at_its_consumer():
    # Rank 1 posts both receives first; F0 still starts when microbatch 0 arrives, not 1.
    F, RF, SB, B = "F", "RECV_F", "SEND_B", "B"
    rank0 = [Action("F", 0, 0), Action("SEND_F", 0, 0), Action("F", 0, 1), Action("SEND_F", 0, 1),
             Action("RECV_B", 0, 0), Action("B", 0, 0), Action("RECV_B", 0, 1), Action("B", 0, 1)]
    rank1 = [Action(RF, 1, 0), Action(RF, 1, 1), Action(F, 1, 0), Action(F, 1, 1),
             Action(B, 1, 0), Action(SB, 1, 0), Action(B, 1, 1), Action(SB, 1, 1)]
    s = pipesim.Schedule(2, 1, 2, "looped", [rank0, rank1]).validate()
    costs = CostModel(forward=1.0, backward=2.0, p2p_latency=0.5)
    starts = starts_of(simulate(s, costs))
    assert starts[(1, "F", 1, 0)] == pytest.approx(1.5)     # not 2.5, mb 1's arrival
    assert starts[(1, "F", 1, 1)] == pytest.approx(2.5)


# -- processor sharing: more ranks than cores ------------------------------------------------------
def sharing_reference(schedule, costs, cores):
    """Start time of every compute action when the ranks share ``cores`` processors, by a plain
    loop over completions (no SimPy): ranks start their next computation as soon as its input
    exists (free, instant messages); the k running ones each progress at min(1, cores / k)."""
    n, pp = schedule.num_stages, schedule.pp
    t = costs.compute_times(n)
    orders = [schedule.compute_order(r) for r in range(pp)]
    idx = [0] * pp
    made = set()                       # ("F" | "G", stage, mb): outputs and input gradients
    running = {}                       # rank -> [remaining work, action]
    start, now = {}, 0.0

    def ready(op, s, mb):
        if op == "F":
            return s == schedule.first_stage(mb) or ("F", s - 1, mb) in made
        if op in ("B", "I"):
            return s == schedule.last_stage(mb) or ("G", s + 1, mb) in made
        return True

    def scale(action):
        return costs.overlap_factor if len(action.parts) > 1 else 1.0

    sub = [0] * pp                     # the next part of the rank's current action
    while True:
        for r in range(pp):
            if r not in running and idx[r] < len(orders[r]):
                # an OVERLAP_F_B runs its parts back to back: once both inputs are there when
                # they run together (factor != 1), else each part once its own is
                action = orders[r][idx[r]]
                parts, k = action.parts, sub[r]
                together = len(parts) > 1 and costs.overlaps_parts
                if all(ready(*p) for p in parts) if together and k == 0 else ready(*parts[k]):
                    op, s, mb = parts[k]
                    running[r] = [t[op][s] * scale(action), action, k]
                    start[(r, op, s, mb)] = now
        if not running:
            break
        rate = min(1.0, cores / len(running))
        dt = min(w for w, _, _ in running.values()) / rate
        now += dt
        for r in list(running):
            running[r][0] -= dt * rate
            if running[r][0] <= 1e-12:
                _, action, k = running.pop(r)
                if k + 1 < len(action.parts):
                    sub[r] = k + 1
                    if costs.overlaps_parts:   # together: the next part goes on at once
                        op, s, mb = action.parts[k + 1]
                        running[r] = [t[op][s] * scale(action), action, k + 1]
                        start[(r, op, s, mb)] = now
                    continue
                for op, s, mb in action.parts:  # its outputs leave at its end
                    made.add(("F" if op == "F" else "G", s, mb))
                sub[r] = 0
                idx[r] += 1
    assert all(idx[r] == len(orders[r]) for r in range(pp)), "reference got stuck"
    return start


def test_processor_sharing_by_hand():
    # 1F1B, pp = 2, m = 2, F = 1, B = 2, one core: the two ranks halve it whenever both compute.
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    r = simulate(s, CostModel(forward=1.0, backward=2.0), cores=1)
    spans = {(row.rank, row.op, row.microbatch): (row.start, row.end)
             for row in r.trace[r.trace["kind"] == "compute"].itertuples()}
    assert spans == {(0, "F", 0): (0, 1), (0, "F", 1): (1, 3), (1, "F", 0): (1, 3),
                     (1, "B", 0): (3, 5), (0, "B", 0): (5, 9), (1, "F", 1): (5, 7),
                     (1, "B", 1): (7, 10), (0, "B", 1): (10, 12)}
    assert r.makespan == 12.0 and r.options["cores"] == 1
    assert simulate(s, CostModel(forward=1.0, backward=2.0), cores=2).makespan == \
        simulate(s, CostModel(forward=1.0, backward=2.0)).makespan    # a core per rank
    with pytest.raises(ValueError, match="cores"):
        simulate(s, cores=0)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(NAMES), pp=st.integers(2, 5), m=st.integers(1, 8),
       vpp=st.integers(1, 3), cores=st.sampled_from([1, 1.5, 2, 3]))
def test_processor_sharing_matches_reference(data, name, pp, m, vpp, cores):
    schedule = build_any(name, pp, m, vpp)
    costs = draw_costs(data, schedule.num_stages, "none")
    result = simulate(schedule, costs, cores=cores)
    expected = sharing_reference(schedule, costs, cores)
    got = starts_of(result)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    times = costs.compute_times(schedule.num_stages)
    work = sum(times[p.op][p.stage] * (costs.overlap_factor if len(a.parts) > 1 else 1.0)
               for r in range(schedule.pp) for a in schedule.compute_order(r) for p in a.parts)
    # one core never idles while work is left (free messages, a deadlock-free schedule)
    if cores == 1:
        assert result.makespan == pytest.approx(work, rel=1e-9)
    assert result.makespan >= max(work / cores, simulate(schedule, costs).makespan) * (1 - 1e-9)
