"""Searches over schedules that simulate their candidates (zb-auto).

They sit outside :mod:`pipesim.schedule` so that the schedule IR never imports the simulator:
the dependency runs one way (search -> schedule, engine, costs). Importing this package
registers ``zb-auto`` with :func:`pipesim.build_schedule` after the hand-made builders (so
``pipesim list`` keeps its order); ``import pipesim`` imports it.
"""
from ..schedule.registry import _load_builders

_load_builders()                     # the hand-made builders first: registration order is shown

from . import zb_auto  # noqa: E402,F401  registers zb-auto

__all__ = ["zb_auto"]
