"""Lists on the command line read the same in every command: ``--schedules 1f1b,zbv`` and
``--schedules 1f1b zbv`` name the same two schedules (`pipesim.plan.flags.values`)."""
from __future__ import annotations

from ..plan.flags import values

names = values(str)
SCHEDULES_HELP = ("schedule names (see `pipesim list`), comma- or space-separated: "
                  "1f1b,zbv or 1f1b zbv")
