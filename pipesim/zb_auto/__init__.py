"""zb-auto: a schedule found by simulating its candidates (Qi et al. 2024's automatic search).

It sits outside :mod:`pipesim.schedule` so that the schedule IR never imports the simulator:
the dependency runs one way (zb_auto -> schedule, sim). Importing this package registers
``zb-auto`` with :func:`pipesim.build_schedule` after the hand-made builders (so ``pipesim
list`` keeps its order); ``import pipesim`` imports it.
"""
from ..schedule.registry import schedule_names

schedule_names()                     # the hand-made builders register first: the order is shown

from . import search  # noqa: E402,F401  registers zb-auto

__all__ = ["search"]
