"""Errors raised by pipesim. Messages name the rank, action or field so a user can act on them."""
from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule is malformed, cannot be built for the given parameters, or would deadlock.

    ``rank``, ``step`` (the action's position in that rank's list) and ``action``: where it
    fails, when the error is about one action (None otherwise); ``grid``: the schedule's
    rank-by-step grid with that step marked, shown under the message."""

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None,
                 action: object = None, grid: str | None = None) -> None:
        super().__init__(message if grid is None else f"{message}\n{grid}")
        self.message = message
        self.rank, self.step, self.action, self.grid = rank, step, action, grid


class PlanError(ValueError):
    """A plan cannot run: the message names the field and the rule it breaks."""
