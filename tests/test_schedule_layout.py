"""What a planner asks of a schedule without building it: the builder's refusal (its registered
check) and each rank's model parts and microbatch runs (its placement), each compared with what
the built schedule says on a sweep of (pp, vpp, microbatches)."""
import pytest

import pipesim
from pipesim import ScheduleError
from pipesim.schedule.registry import (schedule_names, schedule_part_runs, schedule_rank_parts,
                                       schedule_refusal)

NAMES = [n for n in schedule_names() if n != "zb-auto"]     # zb-auto needs costs to build


def _built(name, pp, vpp, m):
    try:
        return pipesim.build_schedule(name, pp=pp, vpp=vpp, microbatches=m), None
    except ScheduleError as exc:
        return None, str(exc)


@pytest.mark.parametrize("name", NAMES)
def test_the_check_refuses_what_the_builder_refuses_in_its_words(name):
    for pp in range(1, 9):
        for vpp in range(1, 5):
            for m in range(1, 21):
                schedule, why = _built(name, pp, vpp, m)
                assert schedule_refusal(name, pp, vpp, m) == why, (pp, vpp, m)


@pytest.mark.parametrize("name", NAMES)
def test_placement_and_runs_are_those_of_the_built_schedule(name):
    for pp in range(1, 9):
        for vpp in range(1, 5):
            for m in (1, 2, 3, 4, 7, 8, 16, 17, 24):
                s, _ = _built(name, pp, vpp, m)
                if s is None:
                    continue
                parts = tuple(tuple(s.stage_part(x) for x in s.rank_stages(r)) for r in range(pp))
                assert schedule_rank_parts(name, pp, s.parts_per_rank) == parts, (pp, vpp, m)
                runs = [{} for _ in range(pp)]
                for r in range(pp):
                    for a in s.compute_parts(r):
                        if a.op == "F":
                            part = s.stage_part(a.stage)
                            runs[r][part] = runs[r].get(part, 0) + 1
                assert list(schedule_part_runs(name, pp, s.parts_per_rank, m)) == runs, \
                    (pp, vpp, m)


def test_dualpipe_ranks_hold_a_part_and_a_copy_of_another():
    """DualPipe on 4 ranks: rank r holds part r and a copy of part 3 - r; 10 microbatches, the
    first 5 through the parts, the other 5 through the copies."""
    assert schedule_rank_parts("dualpipe", 4, 1) == ((0, 3), (1, 2), (2, 1), (3, 0))
    assert schedule_part_runs("dualpipe", 4, 1, 10) == ({0: 5, 3: 5}, {1: 5, 2: 5},
                                                        {2: 5, 1: 5}, {3: 5, 0: 5})
    assert schedule_rank_parts("zbv", 3, 2) == ((0, 5), (1, 4), (2, 3))
    assert schedule_rank_parts("interleaved", 2, 3) == ((0, 2, 4), (1, 3, 5))


def test_a_plan_derives_without_building_its_schedule(monkeypatch):
    """derive() and the cheap bounds read the placement; the exact bounds still build."""
    from pipesim.planner.bounds import plan_bounds
    from pipesim.schedule import registry

    plan = pipesim.Plan.create("llama3-8b", "H100", schedule="dualpipe", pp=4, dp=2,
                               global_batch_size=16)
    want = plan.derive()
    monkeypatch.setattr(registry, "_built", None)      # any build would now fail
    got = plan.derive()
    assert [t.seconds for t in got.tail] == [t.seconds for t in want.tail]
    assert got.rank_buffers == want.rank_buffers
    plan_bounds(plan, got, exact_order=False)


def test_the_build_cache_keeps_schedules_up_to_its_action_budget():
    """Least recently used out first, once the kept schedules' compute actions pass the budget;
    a kept schedule is handed out again as the same object."""
    from pipesim.schedule.registry import _BuildCache

    cache = _BuildCache(max_actions=1000, max_entries=10)
    a = cache("1f1b", 4, 1, 100, False, 0)                # 4 ranks x 200 actions = 800
    assert cache("1f1b", 4, 1, 100, False, 0) is a and cache.hits == 1
    b = cache("gpipe", 2, 1, 50, False, 0)                # 200 more: 1000, both kept
    assert cache("1f1b", 4, 1, 100, False, 0) is a and cache.misses == 2
    cache("zb-h1", 1, 1, 10, False, 0)                    # 30 more: the oldest used (gpipe) out
    assert cache("1f1b", 4, 1, 100, False, 0) is a
    assert cache("gpipe", 2, 1, 50, False, 0) is not b and cache.misses == 4
    with pytest.raises(ScheduleError, match="dualpipev needs microbatches"):
        cache("dualpipev", 4, 2, 4, False, 0)


@pytest.mark.parametrize("name", NAMES)
def test_the_searched_vpp_is_one_the_builder_takes(name):
    """What the planner enumerates for a schedule (its registered searched_vpp) builds: vpp 1
    or 2 alone, or every vpp > 1 (interleaved with microbatches a multiple of pp)."""
    from pipesim.schedule.registry import schedule_info

    want = schedule_info(name).searched_vpp
    for vpp in ((want,) if want else range(2, 6)):
        assert schedule_refusal(name, 4, vpp, 16) is None, vpp
    if want == 2:
        assert schedule_refusal(name, 4, 1, 16) is not None


def test_plans_of_one_bounds_key_derive_and_bound_alike():
    """The search derives and bounds one plan per `bounds_key`: every plan of a small space,
    derived and bounded on its own, has its key's figures; the keys join gpipe, 1f1b, zb-h1 and
    zb-h2, and the V schedules."""
    from collections import defaultdict

    from pipesim.planner import SearchSpace
    from pipesim.planner.bounds import bounds_key, plan_bounds
    from pipesim.planner.enumerate import enumerate_plans

    space = SearchSpace("llama3-8b", gpus=16, gbs=64, cp=(1,), mbs=(1,), zero=(0, 1),
                        recompute=("none",))
    groups = defaultdict(list)
    for plan in enumerate_plans(space).plans:
        groups[bounds_key(plan)].append(plan)
    assert None not in groups
    names = [{p.schedule_name for p in g} for g in groups.values()]
    assert {"gpipe", "1f1b", "zb-h1", "zb-h2"} in names
    assert {"zbv", "dualpipev", "v-half", "v-min"} in names
    for group in groups.values():
        figures = set()
        for plan in group:
            d = plan.derive()
            b = plan_bounds(plan, d, exact_order=False)
            figures.add((tuple(d.costs.forward), tuple(d.costs.backward), tuple(d.rank_buffers),
                         tuple(t.seconds for t in d.tail), b.step_time, b.memory))
        assert len(figures) == 1, [p.schedule_name for p in group]
