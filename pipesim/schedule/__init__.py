"""The schedule IR: actions, placement, the Schedule value, builders and validation."""
from .action import Action
from .registry import build_schedule, schedule_info, schedule_names
from .schedule import Schedule

__all__ = ["Action", "Schedule", "build_schedule", "schedule_info", "schedule_names"]
