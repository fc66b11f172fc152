"""The planner: search the configurations of a cluster and pick the fastest plan that fits.

``enumerate`` lists every valid plan of a :class:`SearchSpace` (refusals counted by reason),
``bounds`` gives each a sound lower bound on its peak memory and its step time, ``search``
simulates the survivors with the full discrete-event model (pruning what cannot fit or cannot
win) and ranks them, ``explain`` compares the winner with its runners-up, ``stability``
re-simulates the top plans under noise. Torch-free, like the rest of pipesim.
"""
from __future__ import annotations

from .bounds import Bounds, plan_bounds
from .enumerate import Enumeration, SearchSpace, enumerate_plans
from .explain import explain
from .search import SearchResult, search
from .stability import jitter_check
from .units import parse_bytes

__all__ = ["Bounds", "Enumeration", "SearchResult", "SearchSpace", "enumerate_plans", "explain",
           "jitter_check", "parse_bytes", "plan_bounds", "search"]
