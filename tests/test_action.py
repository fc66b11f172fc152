import pytest
from hypothesis import given, strategies as st

import pipesim
from pipesim import Action, ScheduleError
from pipesim.schedule.action import ALL_OPS, OVERLAP_F_B


@given(op=st.sampled_from(sorted(ALL_OPS - {OVERLAP_F_B})), stage=st.integers(0, 10_000), mb=st.integers(0, 10_000))
def test_parse_roundtrip(op, stage, mb):
    a = Action(op, stage, mb)
    assert Action.parse(str(a)) == a
    assert hash(Action.parse(str(a))) == hash(a)


def test_compact_text_matches_torch_notation():
    assert str(Action("F", 2, 5)) == "2F5"
    assert str(Action("I", 0, 3)) == "0I3"
    assert str(Action("SEND_F", 1, 0)) == "1SEND_F0"
    assert Action.parse("12RECV_B34") == Action("RECV_B", 12, 34)


def test_action_is_immutable():
    a = Action("F", 0, 0)
    with pytest.raises(AttributeError):
        a.op = "B"


@pytest.mark.parametrize("text", ["", "F1", "1F", "1X2", "1SEND2", "a1F2", "1F2x"])
def test_parse_rejects_garbage(text):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


def test_public_names():
    for name in ("build_schedule", "schedule_names", "Schedule", "Action", "ScheduleError"):
        assert hasattr(pipesim, name)
