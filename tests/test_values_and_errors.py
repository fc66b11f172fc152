"""Values that stay values, and schedule errors that say where.

* A Schedule (what build_schedule's cache hands every caller) and the other values the cache
  or the planner share (CostModel, Plan, a builder's registry entry) reject writes: one
  caller cannot rename or reshape another's.
* A ScheduleError about one action carries ``rank``, ``step`` (its position in the rank's
  action list) and ``action``, and its message shows the rank-by-step grid with that step
  marked (as torch.distributed.pipelining's ``_format_pipeline_order(..., error_step_number)``).
"""
import dataclasses
import pickle

import pytest
from hypothesis import given, settings, strategies as st

import pipesim
from pipesim import Action, CostModel, Schedule, ScheduleError
from pipesim.schedule.grid import format_grid

A = Action.parse


def test_a_built_schedule_rejects_writes_and_later_callers_see_it_unchanged():
    a = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    for name, value in (("name", "x"), ("pp", 3), ("placement", (1, 0)), ("_orders", ()),
                        ("routes", None), ("recv_lookahead", 2), ("brand_new", 1)):
        with pytest.raises(AttributeError, match=f"Schedule is immutable \\(cannot set '{name}'\\)"):
            setattr(a, name, value)
    with pytest.raises(AttributeError, match="immutable"):
        del a.name
    b = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    assert b is a and b.name == "1f1b" and b.pp == 2 and b.placement == (0, 1)
    # what a caller does instead: a new value, the shared one untouched
    renamed = a.with_orders([a.compute_order(r) for r in range(2)], name="x")
    assert renamed.name == "x" and renamed == a and a.name == "1f1b"
    # pickled and copied schedules are values too
    again = pickle.loads(pickle.dumps(a))
    assert again == a and again.name == "1f1b"
    with pytest.raises(AttributeError):
        again.name = "y"


def test_shared_values_of_the_cache_and_the_planner_reject_writes():
    costs = CostModel(forward=[1.0, 2.0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        costs.forward = (3.0, 3.0)
    assert isinstance(costs.forward, tuple)            # no list to append to either
    info = pipesim.schedule_info("1f1b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.placement = "v"
    plan = pipesim.Plan.__new__(pipesim.Plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pp = 4


def sched(rows, m=1, placement="looped"):
    return Schedule(len(rows), 1, m, placement, [[A(x) for x in r.split()] for r in rows])


def test_a_misplaced_action_error_names_rank_step_action_and_marks_the_grid():
    s = sched(["0F0 1F0 0B0", "1B0"])
    with pytest.raises(ScheduleError) as info:
        s.validate()
    e = info.value
    full = s.actions(0)                                # the grid shows the lists, comms included
    assert (e.rank, e.action) == (0, A("1F0")) and full[e.step] == A("1F0")
    assert [str(a) for a in full[:e.step]] == ["0F0", "0SEND_F0"]
    text = str(e)
    assert text.startswith("rank 0: action 1F0 runs stage 1")
    lines = text.splitlines()
    assert lines[1].split() == ["Rank", "0", "Rank", "1"]
    marked = [ln for ln in lines if "<--" in ln]
    assert marked == [next(ln for ln in lines if ln.startswith(f"Step {e.step}"))]
    assert "[1F0]" in marked[0] and "rank 0 fails here" in marked[0]


def test_a_deadlock_marks_every_stuck_rank_at_its_step():
    s = sched(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], m=2)
    with pytest.raises(ScheduleError) as info:
        s.validate()
    e = info.value
    full = [s.actions(r) for r in range(2)]
    assert e.rank == 0 and e.action == A("0RECV_B0") and full[0][e.step] == A("0RECV_B0")
    assert str(e).startswith("deadlock: rank 0 is stuck at 0RECV_B0")
    stuck_1 = full[1].index(A("1RECV_F1"))
    assert f"[{A('1RECV_F1')}]" in next(ln for ln in str(e).splitlines()
                                         if ln.startswith(f"Step {stuck_1}"))
    assert e.grid is not None and e.grid in str(e)
    again = pickle.loads(pickle.dumps(e))              # e.g. from a worker process
    assert (again.rank, again.step, again.action) == (e.rank, e.step, e.action)


def test_errors_without_one_action_carry_none():
    with pytest.raises(ScheduleError) as info:
        sched(["0F0", "1F0"]).validate()           # a missing backward: a rank, no step
    assert info.value.step is None and info.value.grid is None


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 5), steps=st.integers(1, 40), data=st.data())
def test_grid_shows_every_rank_and_a_window_around_the_step(pp, steps, data):
    """Independent of any schedule: the grid's cells are the lists' items, one column per rank,
    the marked step's row alone has the arrow, and a step's neighbours within the window are
    shown (rows elsewhere elided)."""
    lists = [[f"{r}x{k}" for k in range(data.draw(st.integers(0, steps)))] for r in range(pp)]
    lists[0] = [f"0x{k}" for k in range(steps)]
    step = data.draw(st.integers(0, steps - 1))
    text = format_grid(lists, step, 0, window=3)
    rows = [ln for ln in text.splitlines() if ln.startswith("Step ")]
    shown = [int(ln.split(":")[0].split()[1]) for ln in rows]
    assert shown == list(range(max(0, step - 3), min(steps, step + 4)))
    arrows = [ln for ln in rows if "<--" in ln]
    assert len(arrows) == 1 and arrows[0].startswith(f"Step {step}") and f"[0x{step}]" in arrows[0]
    for ln, k in zip(rows, shown):
        cells = ln.split(":", 1)[1].split("<--")[0].split()
        want = [f"[{lst[k]}]" if (r, k) == (0, step) else lst[k]
                for r, lst in enumerate(lists) if k < len(lst)]
        assert cells == want
