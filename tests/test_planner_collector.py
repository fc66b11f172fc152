"""The search pauses CPython's full collections and gives the collector its settings back."""
import gc
import importlib

import pytest

from pipesim.planner.collector import full_collections_paused

# the module (pipesim.planner's ``search`` is the function)
search_mod = importlib.import_module("pipesim.planner.search")

PAUSED = 1 << 30


def test_full_collections_wait_inside_and_the_thresholds_come_back_even_on_an_error():
    before = gc.get_threshold()
    with full_collections_paused():
        t0, t1, t2 = gc.get_threshold()
        assert (t0, t1) == before[:2] and t2 >= PAUSED      # young collections as before
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError):
        with full_collections_paused():
            raise RuntimeError("stop")
    assert gc.get_threshold() == before


def test_a_cycle_dropped_inside_is_still_collected_by_a_young_collection():
    class Node:
        pass

    gc.collect()
    with full_collections_paused():
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        gc.collect(0)
        gc.collect(1)
        assert not any(type(o) is Node for o in gc.get_objects())


def test_search_runs_with_full_collections_paused(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def spy(space):               # the search's first step, inside it
        seen.append(gc.get_threshold()[2])
        raise Stop

    monkeypatch.setattr(search_mod, "enumerate_plans", spy)
    before = gc.get_threshold()
    with pytest.raises(Stop):
        search_mod.search(object(), memory_limit=1.0)
    assert seen[0] >= PAUSED and gc.get_threshold() == before
