"""OVERLAP_F_B in the IR (text, files, validation, comms, simulator) and the dualpipev builder."""
import types

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pipesim
from pipesim import Action, CostModel, Schedule, ScheduleError, simulate
from pipesim.schedule.action import Overlap
from pipesim.schedule.io import schedule_from_csv, schedule_from_json, schedule_to_csv, schedule_to_json

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_dualpipev_order(pp, m):
    """torch's own ScheduleDualPipeV order builder, without building stages: the method only
    reads the group size and the microbatch count from ``self``."""
    fake = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m)
    return {r: torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, r)
            for r in range(pp)}


# -- the action ----------------------------------------------------------------------------
@given(fs=st.integers(0, 99), fm=st.integers(0, 99), bs=st.integers(0, 99), bm=st.integers(0, 99),
       bop=st.sampled_from(["B", "I"]))
def test_overlap_text_is_torchs(fs, fm, bs, bm, bop):
    ours = Overlap(Action("F", fs, fm), Action(bop, bs, bm))
    text = str(ours)
    assert text == f"({fs}F{fm};{bs}{bop}{bm})OVERLAP_F_B"
    theirs = torch_schedules._Action.from_str(text)
    assert theirs.computation_type == torch_schedules.OVERLAP_F_B
    assert [str(a) for a in theirs.sub_actions] == [f"{fs}F{fm}", f"{bs}{bop}{bm}"]
    assert str(theirs) == text
    back = Action.parse(text)
    assert back == ours and hash(back) == hash(ours) and back.parts == ours.parts
    op, stage, mb = back                               # unpacks like any action
    assert (op, stage, mb) == ("OVERLAP_F_B", fs, fm) and back.is_compute


def test_overlap_equality_and_errors():
    a = Overlap(Action("F", 0, 3), Action("B", 2, 1))
    assert a != Overlap(Action("F", 0, 3), Action("B", 2, 2))
    assert a != Action("OVERLAP_F_B", 0, 3) and Action("F", 0, 3) != a
    with pytest.raises(AttributeError):
        a.op = "F"
    with pytest.raises(ScheduleError, match="expected a forward F then a backward B or I"):
        Overlap(Action("B", 2, 1), Action("F", 0, 3))
    with pytest.raises(ScheduleError, match="cannot parse"):
        Action.parse("(0F3;2X1)OVERLAP_F_B")


# -- the builder against torch's ------------------------------------------------------------
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
def test_dualpipev_is_torchs_order(pp):
    for m in range(2 * pp, 2 * pp + 7):
        theirs = torch_dualpipev_order(pp, m)
        s = pipesim.build_schedule("dualpipev", pp=pp, vpp=2, microbatches=m).validate()
        for r in range(pp):
            assert [str(a) for a in s.compute_order(r)] == [str(a) for a in theirs[r]], (pp, m, r)


def test_dualpipev_constraints_in_words():
    with pytest.raises(ScheduleError, match="dualpipev needs vpp == 2"):
        pipesim.build_schedule("dualpipev", pp=4, microbatches=8)
    with pytest.raises(ScheduleError, match=r"microbatches >= 2\*pp = 8"):
        pipesim.build_schedule("dualpipev", pp=4, vpp=2, microbatches=7)


# -- files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(2, 4), (3, 7), (4, 10)])
def test_csv_and_json_round_trip_through_torchs_parser(tmp_path, pp, m):
    s = pipesim.build_schedule("dualpipev", pp=pp, vpp=2, microbatches=m)
    assert schedule_from_json(schedule_to_json(s)) == s
    text = schedule_to_csv(s)
    assert schedule_from_csv(text, name="dualpipev") == s
    # every cell reads back in torch's parser as what torch's own builder made
    theirs = torch_dualpipev_order(pp, m)
    rows = [line.split(",") for line in text.strip().split("\n")]
    for r, row in enumerate(rows):
        assert [torch_schedules._Action.from_str(c) for c in row] == theirs[r]
    # with communication: the overlap's receives before it, its parts' sends after it
    full = schedule_from_csv(schedule_to_csv(s, with_comms=True))
    assert full.has_explicit_comms and full.validate(single_channel=True)
    assert [full.compute_order(r) for r in range(pp)] == [s.compute_order(r) for r in range(pp)]


def test_comms_around_an_overlap():
    s = pipesim.build_schedule("dualpipev", pp=2, vpp=2, microbatches=4)
    acts = [str(a) for a in s.actions(1)]
    i = acts.index("(2F2;1B0)OVERLAP_F_B")
    # 2F2's input comes from stage 1 on this rank; 1B0's gradient from stage 2, here too
    assert acts[i + 1: i + 3] == ["2SEND_F2", "1SEND_B0"]
    j = acts.index("(1F3;2B1)OVERLAP_F_B")
    assert acts[j - 2: j] == ["1RECV_F3", "2RECV_B1"]
    early = s.with_recv_lookahead(2).validate()
    assert [a for a in early.actions(1) if not a.op.startswith("RECV")] == \
        [a for a in s.actions(1) if not a.op.startswith("RECV")]


# -- validation --------------------------------------------------------------------------------
def test_overlap_whose_backward_needs_its_forward_is_refused():
    # pp = 1, V placement: stage 1 consumes stage 0's output on the same rank.
    orders = [[Action("F", 0, 0), Overlap(Action("F", 1, 0), Action("B", 0, 0)), Action("B", 1, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0: action \(1F0;0B0\)OVERLAP_F_B: its backward "
                                            r"0B0 needs its forward 1F0"):
        Schedule(1, 2, 1, "v", orders).validate()


def test_overlap_waits_for_both_inputs_deadlock():
    # Run one part after the other and this completes; as one action (both inputs first), rank 0
    # waits for 1B0's gradient, which rank 1 makes only after 1F1, which needs 0F1 from the overlap.
    orders = [[Action("F", 0, 0), Overlap(Action("F", 0, 1), Action("B", 0, 0)), Action("B", 0, 1)],
              [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]]
    flat = [[p for a in o for p in a.parts] for o in orders]
    Schedule(2, 1, 2, "looped", flat).validate()
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 is stuck at 0RECV_B0 waiting for 1SEND_B0"):
        Schedule(2, 1, 2, "looped", orders).validate()


def test_overlap_in_forward_only_schedule_is_refused():
    orders = [[Action("F", 0, 0), Overlap(Action("F", 0, 1), Action("B", 0, 0))]]
    with pytest.raises(ScheduleError, match="forward-only"):
        Schedule(1, 1, 2, "looped", orders, forward_only=True).validate()


# -- the simulator ------------------------------------------------------------------------------
def one_rank_overlap():
    # one rank, two stages on it (V, pp = 1): 0F0 1F0 (0F1;1B0) 0B0 1F1 1B1 0B1
    o = [Action("F", 0, 0), Action("F", 1, 0), Overlap(Action("F", 0, 1), Action("B", 1, 0)),
         Action("B", 0, 0), Action("F", 1, 1), Action("B", 1, 1), Action("B", 0, 1)]
    return Schedule(1, 2, 2, "v", [o]).validate()


@pytest.mark.parametrize("factor", [1.0, 0.75, 0.5])
def test_overlap_duration_is_factor_times_parts(factor):
    s = one_rank_overlap()
    r = simulate(s, CostModel(forward=1.0, backward=3.0, overlap_factor=factor, activation_bytes=1.0))
    tr = r.trace.set_index(["op", "stage", "microbatch"])
    f, b = tr.loc[("F", 0, 1)], tr.loc[("B", 1, 0)]
    assert f["start"] == 2.0 and f["end"] == pytest.approx(2.0 + factor * 1.0)
    assert b["start"] == f["end"] and b["end"] == pytest.approx(2.0 + factor * 4.0)
    assert r.makespan == pytest.approx(2 * 1.0 + 4 * factor + 3 + 1 + 3 + 3)   # the rest as is
    # memory: F adds at its start, B frees at its end, as for the parts on their own
    assert r.peak_memory == [3.0]


def test_overlap_duration_from_a_function():
    seen = []

    def model(parts, seconds):
        seen.append((tuple(str(p) for p in parts), seconds))
        return max(seconds) + 0.25

    s = one_rank_overlap()
    r = simulate(s, CostModel(forward=1.0, backward=3.0, overlap_factor=model))
    assert seen == [(("0F1", "1B0"), (1.0, 3.0))]
    tr = r.trace.set_index(["op", "stage", "microbatch"])
    assert tr.loc[("B", 1, 0), "end"] - tr.loc[("F", 0, 1), "start"] == pytest.approx(3.25)
    with pytest.raises(ValueError, match="overlap_factor is a function"):
        CostModel(overlap_factor=model).to_dict()
    with pytest.raises(ValueError, match="overlap_factor must be > 0"):
        CostModel(overlap_factor=0)
    assert CostModel.from_dict(CostModel(overlap_factor=0.6).to_dict()).overlap_factor == 0.6


def test_unit_steps_give_an_overlap_two_steps():
    from pipesim.schedule.steps import unit_steps

    steps = unit_steps(one_rank_overlap())
    assert [(t, str(a)) for t, a in steps[0]][2:4] == [(2, "0F1"), (3, "1B0")]


# -- DualPipe README: bubble and memory --------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(1, 8), extra=st.integers(0, 8), fwd=st.floats(0.5, 2.0),
       w_share=st.floats(0.1, 1.0), factor=st.floats(0.7, 1.0))
def test_dualpipev_bubble_and_memory_as_the_dualpipe_readme(pp, extra, fwd, w_share, factor):
    """github.com/deepseek-ai/DualPipe README, "Pipeline Bubbles and Memory Usage Comparison":

        | Method    | Bubble                  | Parameter | Activation |
        | DualPipeV | (PP/2-1)(F&B+B-3W)      | 1x        | PP+1       |

    F, B, W: a forward, full backward and weight backward of one chunk; F&B: an overlapped pair.
    DualPipeV is DualPipe cut in half: PP is its number of stages (2 pp, two per rank), so PP/2-1
    = pp-1 and PP+1 = 2pp+1 chunk activations. The formula is exact for the worst rank when a
    chunk's input backward costs what its forward does and W <= I (the simulator, zero comm)."""
    m = 2 * pp + extra
    inp, w = fwd, w_share * fwd
    b = inp + w
    s = pipesim.build_schedule("dualpipev", pp=pp, vpp=2, microbatches=m)
    r = simulate(s, CostModel(forward=fwd, backward_input=inp, backward_weight=w,
                              overlap_factor=factor, activation_bytes=1.0))
    tr = r.trace[r.trace["kind"] == "compute"]
    busy = (tr["end"] - tr["start"]).groupby(tr["rank"]).sum()
    f_and_b = factor * (fwd + b)
    assert max(r.makespan - busy) == pytest.approx((pp - 1) * (f_and_b + b - 3 * w), abs=1e-9)
    assert r.peak_memory == [min(2 * pp + 1, 2 * m)] * pp


# -- the CLI: schedules from files, zb-auto's memory limit ------------------------------------
def test_simulate_schedule_files_and_zb_auto_limit(tmp_path, capsys):
    from pipesim.cli import main

    s = pipesim.build_schedule("dualpipev", pp=2, vpp=2, microbatches=4)
    expected = simulate(s, CostModel.uniform(1.0, 2.0)).makespan
    schedule_to_json(s, tmp_path / "d.json")
    schedule_to_csv(s, tmp_path / "d.csv", with_comms=True)         # torch's compute_comms CSV
    for path in (tmp_path / "d.json", tmp_path / "d.csv"):
        capsys.readouterr()
        assert main(["simulate", str(path)]) == 0
        text = capsys.readouterr().out
        assert f"{expected:g}" in text.replace(",", ""), text
    assert main(["simulate", str(tmp_path / "d.csv"), "--recv-lookahead", "1"]) == 2
    assert "places its SEND/RECV actions itself" in capsys.readouterr().err
    # zb-auto searches with the costs it is simulated with (uniform: 1 byte a microbatch)
    assert main(["simulate", "zb-auto", "--pp", "2", "-m", "4", "--memory-limit", "2B"]) == 0
    with pytest.raises(SystemExit) as refused:                   # refused as it is parsed
        main(["simulate", "zb-auto", "--pp", "2", "-m", "4", "--memory-limit", "0.5B"])
    assert refused.value.code == 2 and "less than one byte" in capsys.readouterr().err
    with pytest.raises(pipesim.ScheduleError, match="memory_limit 0.5 bytes on rank 0 is below"):
        pipesim.build_schedule("zb-auto", pp=2, microbatches=4, memory_limit=0.5,
                               costs=pipesim.CostModel.uniform())
    assert main(["simulate", "1f1b", "--pp", "2", "--memory-limit", "1GB"]) == 2
    assert "--memory-limit applies to zb-auto only" in capsys.readouterr().err
    # --placement narrows zb-auto's vpp-2 search to one placement; the others fix their own
    for placement, last_rank in (("looped", 1), ("v", 0)):   # the rank of stage 3 (of 4)
        trace = tmp_path / f"zb-auto-{placement}.csv"
        assert main(["simulate", "zb-auto", "--pp", "2", "--vpp", "2", "-m", "4",
                     "--placement", placement, "--trace-csv", str(trace)]) == 0
        rows = [line.split(",") for line in trace.read_text().splitlines()[1:]]
        assert {int(r[0]) for r in rows if r[2] == "3"} == {last_rank}
    assert main(["simulate", "zbv", "--pp", "2", "--vpp", "2", "--placement", "v"]) == 2
    assert "--placement applies to zb-auto only" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "d.json"), "--placement", "v"]) == 2
    assert "--placement applies to a named schedule" in capsys.readouterr().err
