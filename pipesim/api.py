"""``pipesim.simulate``: one entry point for a schedule with costs, or a plan.

A :class:`pipesim.Schedule` goes to the engine unchanged (:func:`pipesim.sim.engine.simulate`); a
:class:`pipesim.Plan` derives its costs and returns a :class:`pipesim.sim.plan_report.PlanResult`
(:func:`pipesim.sim.plan_report.simulate_plan`). The engine itself never learns what a plan is.
"""
from __future__ import annotations

from typing import Any

from .sim.engine import simulate as engine_simulate
from .plan.plan import Plan
from .sim.plan_report import simulate_plan


def simulate(target: Any, costs: Any = None, **kwargs: Any) -> Any:
    """Simulate one step of a Schedule under ``costs`` (-> SimResult; options as
    :func:`pipesim.sim.engine.simulate`), or of a Plan (-> PlanResult: step_time,
    tokens_per_s_per_gpu, mfu, hfu, memory_breakdown, fits; option ``comm``)."""
    if isinstance(target, Plan):
        if costs is not None:
            raise ValueError("simulate(plan): the plan derives its own costs; pass "
                             "simulate(plan.build_schedule(), costs) to use others")
        return simulate_plan(target, **kwargs)
    # without options, a plain call: no argument tuple and dict to unpack again
    return engine_simulate(target, costs, **kwargs) if kwargs else engine_simulate(target, costs)

