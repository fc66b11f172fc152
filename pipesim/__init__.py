"""pipesim: pipeline-parallel schedules as data, and a discrete-event model of them.

Pure Python: never imports torch. Heavy pieces (the simpy engine, pandas, matplotlib) are loaded
on first use, so ``import pipesim`` stays cheap for the executor and the CLI.
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import ScheduleError
from .schedule import Action, Schedule, build_schedule, schedule_info, schedule_names
from . import zb_auto as _zb_auto  # noqa: F401  registers zb-auto (a search over the simulator)

# Public names that live in modules loaded on first use: name -> module.
_LAZY = {
    "CostModel": "pipesim.plan.costs",
    "fit_costs": "pipesim.sim.calibrate",
    "simulate": "pipesim.api",
    "Plan": "pipesim.plan.plan",
    "ModelSpec": "pipesim.plan.model",
    "PlanError": "pipesim.errors",
    "SimResult": "pipesim.sim.result",
    "schedule_to_json": "pipesim.schedule.io",
    "schedule_from_json": "pipesim.schedule.io",
    "schedule_to_csv": "pipesim.schedule.io",
    "schedule_from_csv": "pipesim.schedule.io",
}

__all__ = ["Action", "Schedule", "ScheduleError", "build_schedule", "schedule_info",
           "schedule_names", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipesim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
