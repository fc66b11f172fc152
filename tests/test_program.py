"""`lower(schedule) -> Program` against the action lists read directly, on every builder:
rows are the actions with each overlap split (and nothing else changed), every SEND's message
is the one its peer's RECV posts, a computation waits for exactly the receive of its own input
posted before it on its rank, transfers name the placement's ranks, and the program is made
once per schedule. And one `Op` enum numbers the ops everywhere (trace categories, board)."""
import pytest
from hypothesis import given, settings, strategies as st

import pipesim
from pipesim import ScheduleError
from pipesim.schedule.action import flat_parts
from pipesim.schedule.op import TRACE_OPS, Op
from pipesim.schedule.program import BACKWARD, FORWARD, Row, lower, message, message_parts


def built(name, pp, m, lookahead):
    for vpp in (1, 2):
        try:
            return pipesim.build_schedule(name, pp=pp, vpp=vpp, microbatches=m,
                                          recv_lookahead=lookahead)
        except ScheduleError:
            continue
    return None


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from([n for n in pipesim.schedule_names() if n != "zb-auto"]),
       pp=st.integers(1, 5), m=st.integers(1, 10), lookahead=st.integers(0, 2))
def test_program_rows_are_the_actions_with_their_waits_and_messages(name, pp, m, lookahead):
    s = built(name, pp, m, lookahead)
    if s is None:
        return
    s.validate()
    program = lower(s)
    assert lower(s) is program                           # made once, kept on the schedule
    n = s.num_stages
    recv_at = {}                                         # message -> (rank, global row)
    send_at = {}
    for rank in range(s.pp):
        rows = [Row(*r) for r in program.in_turn[rank]]
        flat = flat_parts(s.actions(rank))
        assert [r.action for r in rows] == flat          # overlaps split, nothing else
        first = program.first_row[rank]
        for i, r in enumerate(rows):
            op = Op.of_code(r.code)
            if op in (Op.SEND_F, Op.SEND_B):
                peer = r.stage + 1 if op is Op.SEND_F else r.stage - 1
                d = FORWARD if op is Op.SEND_F else BACKWARD
                assert r.message == (d * n + peer) * m + r.microbatch
                assert r.link == rank * s.pp + s.placement[peer]
                assert r.boundary == min(r.stage, peer)
                send_at[r.message] = rank
            elif op in (Op.RECV_F, Op.RECV_B):
                d = FORWARD if op is Op.RECV_F else BACKWARD
                assert r.message == (d * n + r.stage) * m + r.microbatch
                recv_at[r.message] = (rank, first + i)
        for i, r in enumerate(rows):
            op = Op.of_code(r.code)
            if op in (Op.F, Op.B, Op.I):
                d = FORWARD if op is Op.F else BACKWARD
                own = message(d, r.stage, r.microbatch, n, m)
                earlier = [first + j for j, q in enumerate(rows[:i])
                           if q.message == own and Op.of_code(q.code) in (Op.RECV_F, Op.RECV_B)]
                assert (r.wait, r.wait_row) == ((own, earlier[0]) if earlier else (-1, -1))
            else:
                assert r.wait == -1
    assert send_at.keys() == recv_at.keys() == program.transfers.keys()
    for msg, t in program.transfers.items():
        d, stage, mb = message_parts(msg, n, m)
        sender = stage - 1 if d == FORWARD else stage + 1
        assert (t.direction, t.src, t.dst, t.microbatch) == (d, s.placement[sender],
                                                             s.placement[stage], mb)
        assert t.src == send_at[msg] and (t.dst, t.recv) == recv_at[msg]
        assert t.boundary == min(stage, sender)


def test_an_overlap_is_split_once_and_gated_when_its_parts_run_together():
    s = pipesim.build_schedule("dualpipev", pp=2, vpp=2, microbatches=4).validate()
    program = lower(s)
    assert program.overlaps
    for fwd, bwd in program.overlaps:
        rank, i = program.rank_of_row(fwd)
        f, b = Row(*program.in_turn[rank][i]), Row(*program.in_turn[rank][i + 1])
        assert (Op.of_code(f.code), Op.of_code(b.code)) in ((Op.F, Op.B), (Op.F, Op.I))
        tf, tb = Row(*program.together[rank][i]), Row(*program.together[rank][i + 1])
        assert (tf.gate, tf.gate_row) == (b.wait, b.wait_row) and tf.wait == f.wait
        assert (tb.wait, tb.wait_row) == (-1, -1) and f.gate == -1


def test_one_op_enum_numbers_the_trace_and_the_board():
    from pipesim.sim.spans import _dtypes

    op_dtype, _ = _dtypes()
    assert list(op_dtype.categories) == [op.value for op in TRACE_OPS]
    assert all(Op.of_code(op.code) is op for op in Op)
    assert Op.F == "F" and hash(Op.SEND_B) == hash("SEND_B") and f"{Op.RECV_F}" == "RECV_F"
    r = pipesim.simulate(pipesim.build_schedule("1f1b", pp=2, microbatches=2), step_tail=True)
    codes = r.trace["op"].cat.codes.to_numpy()
    names = r.trace["op"].astype(str).to_numpy()
    assert all(Op.of_code(int(c)).value == nm for c, nm in zip(codes, names))
