"""The planner: search the configurations of a cluster and pick the fastest plan that fits.

``enumerate`` lists every valid plan of a :class:`SearchSpace` (refusals counted by reason),
``bounds`` gives each a sound lower bound on its peak memory and its step time, ``search``
simulates the survivors with the full discrete-event model (pruning what cannot fit or cannot
win) and ranks them, ``explain`` compares the winner with its runners-up, ``stability``
re-simulates the top plans under noise, ``refine`` searches zb-auto's order on the best
layouts. Torch-free, like the rest of pipesim.
"""
from __future__ import annotations

from .bounds import Bounds, plan_bounds
from .enumerate import Enumeration, SearchSpace, enumerate_plans
from .explain import explain
from .refine import Refinement, refine_with_zb_auto
from .search import SearchResult, search
from .stability import jitter_check

__all__ = ["Bounds", "Enumeration", "Refinement", "SearchResult", "SearchSpace",
           "enumerate_plans", "explain", "jitter_check", "plan_bounds",
           "refine_with_zb_auto", "search"]
