"""Errors raised by pipesim. Messages name the rank, action or field so a user can act on them."""


class ScheduleError(ValueError):
    """A schedule is malformed, cannot be built for the given parameters, or would deadlock."""


class PlanError(ValueError):
    """A plan cannot run: the message names the field and the rule it breaks."""
