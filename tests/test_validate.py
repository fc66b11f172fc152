"""Hand-made broken schedules are rejected with messages that name the rank, action and reason."""
import pytest

import pipesim
from pipesim import Action, Schedule, ScheduleError

A = Action.parse


def sched(rows, pp=2, vpp=1, m=1, placement="looped", **kw):
    return Schedule(pp, vpp, m, placement, [[A(t) for t in row.split()] for row in rows], **kw)


def test_good_two_rank_schedule_validates():
    sched(["0F0 0B0", "1F0 1B0"]).validate()


@pytest.mark.parametrize("rows, message", [
    (["0F0 0B0", "1F0"], r"rank 1: backward 1B0 \(or 1I0 \+ 1W0\) is missing"),
    (["0B0", "1F0 1B0"], r"rank 0: action 0B0 comes before its forward 0F0"),
    (["0F0 0F0 0B0", "1F0 1B0"], r"rank 0: action 0F0 appears twice"),
    (["0F0 0B0", "1F0 1W0 1I0"], r"rank 1: action 1W0 comes before its input-gradient 1I0"),
    (["0F0 0B0", "1F0 1I0"], r"rank 1: weight-gradient 1W0 is missing"),
    (["0F0 0B0 0I0 0W0", "1F0 1B0"], r"both a full backward B and a split backward"),
    (["0F0 0B0", "1F0 1B0 1F1"], r"rank 1: action 1F1 names microbatch 1, outside 0..0"),
    (["0F0 1F0 0B0", "1B0"], r"rank 0: action 1F0 runs stage 1, which the placement puts on rank 1"),
    (["0F0", "1F0"], r"forward 0F0 ... backward|backward 0B0 \(or"),
])
def test_broken_orders_are_rejected(rows, message):
    with pytest.raises(ScheduleError, match=message):
        sched(rows).validate()


def test_deadlock_names_every_stuck_rank():
    # Rank 0 waits for the gradient of microbatch 1 before it has sent the forward of microbatch 1;
    # rank 1 waits for that forward. Classic cross-order deadlock.
    s = sched(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], m=2)
    with pytest.raises(ScheduleError) as info:
        s.validate()
    text = str(info.value)
    assert text.startswith("deadlock:")
    assert "rank 0 is stuck at 0RECV_B0 waiting for 1SEND_B0 from rank 1" in text
    assert "rank 1 is stuck at 1RECV_F1 waiting for 0SEND_F1 from rank 0" in text


def test_deadlock_on_same_rank_v_turn():
    # pp=2 V placement: stage 2 needs stage 1's forward, both on rank 1, but the order has 2F0 first.
    s = Schedule(2, 2, 1, "v", [[A("0F0"), A("3F0"), A("3B0"), A("0B0")],
                                [A("2F0"), A("1F0"), A("2B0"), A("1B0")]])
    with pytest.raises(ScheduleError, match=r"rank 1 is stuck at 2F0 waiting for the forward 1F0 on this rank"):
        s.validate()


def test_hand_made_comms_unmatched_send():
    s = sched(["0F0 0SEND_F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(ScheduleError, match=r"rank 0: action 0SEND_F0 is a duplicate"):
        s.validate()
    s = sched(["0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(ScheduleError, match=r"rank 1: action 1RECV_F0 has no matching 0SEND_F0 on rank 0"):
        s.validate()


def test_hand_made_comms_missing_receive_deadlocks():
    # Rank 1 computes 1F0 without receiving its input: it can never have it.
    s = sched(["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1RECV_F0 1B0 1SEND_B0"])
    with pytest.raises(ScheduleError, match=r"rank 1 is stuck at 1F0 waiting for a receive 1RECV_F0"):
        s.validate()


def test_hand_made_comms_equal_inserted_ones():
    built = pipesim.build_schedule("1f1b", pp=3, microbatches=4)
    explicit = Schedule(3, 1, 4, "looped", [built.actions(r) for r in range(3)])
    assert explicit.has_explicit_comms and explicit.validate() == built


def test_comm_between_same_rank_stages_rejected():
    s = Schedule(2, 2, 1, "v", [[A("0F0"), A("3F0"), A("3B0"), A("0B0")],
                                [A("1F0"), A("1SEND_F0"), A("2RECV_F0"), A("2F0"), A("2B0"), A("1B0")]])
    with pytest.raises(ScheduleError, match="same rank"):
        s.validate()


@pytest.mark.parametrize("kwargs, message", [
    (dict(placement=(0, 0)), "expected vpp = 1"),
    (dict(placement=(0, 5)), "stage 1 on rank 5"),
    (dict(placement=(0, 1, 0)), "placement has 3 stages"),
])
def test_bad_placement(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        sched(["0F0 0B0", "1F0 1B0"], **kwargs)


def test_wrong_number_of_ranks_and_bad_ops():
    with pytest.raises(ScheduleError, match="got action lists for 1 ranks, expected pp = 2"):
        Schedule(2, 1, 1, "looped", [[A("0F0")]])
    with pytest.raises(ScheduleError, match="unknown op 'X'"):
        Schedule(1, 1, 1, "looped", [[Action("X", 0, 0)]])
    with pytest.raises(ScheduleError, match="forward-only"):
        sched(["0F0 0B0", "1F0 1B0"], forward_only=True).validate()
