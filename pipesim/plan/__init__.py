"""Plans: a training configuration (model, parallelism, cluster, schedule, partition) as one value.

``Plan`` derives the per-stage :class:`pipesim.CostModel` (``plan.costs()``) and is simulated by
:func:`pipesim.simulate` (:mod:`pipesim.sim.plan_report`). Torch-free, like the rest of pipesim.
"""
from __future__ import annotations

from ..errors import PlanError
from .cluster import Cluster, Link
from .model import ModelSpec, get_model, model_names
from .parallelism import Parallelism
from .plan import Plan

__all__ = ["Cluster", "Link", "ModelSpec", "Parallelism", "Plan", "PlanError", "get_model",
           "model_names"]

