"""JSON and torch.distributed.pipelining CSV round trips, both directions."""
import json

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import pipesim
from pipesim import ScheduleError
from pipesim.schedule.io import schedule_from_csv, schedule_from_json, schedule_to_csv, schedule_to_json


def buildable(name, pp, vpp, m):
    try:
        return pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp)
    except ScheduleError:
        return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(pipesim.schedule_names()), pp=st.integers(1, 8),
       vpp=st.integers(1, 3), m=st.integers(1, 24))
@example(name="dualpipe", pp=2, vpp=1, m=4)  # routed: CSV refused, JSON round trip
@example(name="zbv", pp=2, vpp=2, m=4)
def test_json_and_csv_round_trip(name, pp, vpp, m):
    s = buildable(name, pp, vpp, m)
    if s is None:
        return
    back = schedule_from_json(schedule_to_json(s))
    assert back == s and back.name == s.name and back.placement == s.placement
    if s.has_routes or s.has_copies:
        # torch's CSV has no routes or copies: the export refuses in words, JSON carries it
        assert back.routes == s.routes and back.stage_parts == s.stage_parts
        with pytest.raises(ScheduleError, match="cannot be written as torch"):
            schedule_to_csv(s)
        return
    from_csv = schedule_from_csv(schedule_to_csv(s), name=name)
    assert from_csv == s and from_csv.placement == s.placement
    # with communication, ordered for torch's runtime (one channel per pair of ranks): the
    # same computations, the same sends; receives posted no later than pipesim posts them
    with_comms = schedule_from_csv(schedule_to_csv(s, with_comms=True))
    assert with_comms.has_explicit_comms or pp == 1
    with_comms.validate(single_channel=True)
    for r in range(pp):
        assert with_comms.compute_order(r) == s.compute_order(r)
        ours, theirs = s.actions(r), with_comms.actions(r)
        assert sorted(ours) == sorted(theirs)
        assert [a for a in theirs if not a.op.startswith("RECV")] == \
            [a for a in ours if not a.op.startswith("RECV")]
        def computes_before(actions):
            seen, out = 0, {}
            for a in actions:
                if a.is_compute:
                    seen += 1
                elif a.op.startswith("RECV"):
                    out[a] = seen
            return out
        late, early = computes_before(ours), computes_before(theirs)
        assert all(early[a] <= late[a] for a in late), r


def test_files_round_trip(tmp_path):
    s = pipesim.build_schedule("looped-bfs", pp=2, microbatches=3, vpp=2)
    schedule_to_json(s, tmp_path / "s.json")
    schedule_to_csv(s, tmp_path / "s.csv")
    assert schedule_from_json(tmp_path / "s.json") == s
    assert schedule_from_csv(str(tmp_path / "s.csv")) == s
    assert json.loads((tmp_path / "s.json").read_text())["placement"] == [0, 1, 0, 1]


def test_reads_torch_csv_with_idle_cells():
    # torch writes None (an idle slot) as an empty cell; a V placement is inferred from the stages.
    text = "0F0,,3F0,3I0,3W0,0I0,0W0\n,1F0,2F0,2I0,1I0,2W0,1W0\n"
    s = schedule_from_csv(text)
    assert (s.pp, s.vpp, s.num_microbatches, s.placement) == (2, 2, 1, (0, 1, 1, 0))
    assert s.placement_kind == "v"
    s.validate()


def test_torch_wrote_this_csv(tmp_path):
    """A CSV written by torch's own _dump_csv loads and validates here, and ours loads there."""
    torch_sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    ours = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    path = tmp_path / "ours.csv"
    schedule_to_csv(ours, path)
    # torch's parser reads every cell of our file
    import csv
    with open(path, newline="") as f:
        parsed = [[torch_sched._Action.from_str(c) for c in row] for row in csv.reader(f)]
    assert [[str(a) for a in row] for row in parsed] == [[str(a) for a in ours.compute_order(r)] for r in range(2)]
    # and torch's _Action text is ours
    assert str(torch_sched._Action(2, torch_sched._ComputationType.FORWARD, 5)) == "2F5"


@pytest.mark.parametrize("text, message", [
    ("0F0,0Q1\n", r"row 0 \(rank 0\): cannot parse action '0Q1'"),
    ("0F0,1F0\n1B0\n", "stage 1 appears on ranks 0 and 1"),
    ("0F0,0B0\n2F0,2B0\n", r"stages \[1\] have no actions"),
])
def test_bad_csv(text, message):
    with pytest.raises(ScheduleError, match=message):
        schedule_from_csv(text)


def test_bad_json(tmp_path):
    with pytest.raises(ScheduleError, match="not valid JSON"):
        schedule_from_json("{oops")
    with pytest.raises(ScheduleError, match="field 'format'"):
        schedule_from_json('{"format": "x"}')
    with pytest.raises(ScheduleError, match="missing field 'pp'"):
        schedule_from_json('{"format": "pipesim.schedule", "version": 1}')
    with pytest.raises(ScheduleError, match="no such file"):
        schedule_from_json(tmp_path / "missing.json")


@pytest.mark.parametrize("name", [n for n in pipesim.schedule_names() if n != "dualpipe"])
def test_torch_csv_with_comms_exports_a_receive_lookahead(name):
    """pipeexec runs with its receives posted one computation early (recv_lookahead 1); the
    torch export of that schedule orders the receives for torch's one-channel matching, so it
    is the export of the same compute order without the lookahead (a lookahead says where
    *inserted* receives go; the exported ones are placed for torch)."""
    vpp = 2 if name in ("interleaved", "zbv", "dualpipev", "v-min", "v-half", "looped-bfs") else 1
    s = pipesim.build_schedule(name, pp=2, vpp=vpp, microbatches=4)
    early = schedule_to_csv(s.with_recv_lookahead(1), with_comms=True)
    assert early == schedule_to_csv(s, with_comms=True)
    back = schedule_from_csv(early)
    assert back.has_explicit_comms and back.recv_lookahead == 0
    back.validate(single_channel=True)
