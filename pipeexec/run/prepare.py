"""A run validated once, before any rank starts, with what validation derived.

`prepare` checks a `TrainConfig` (every reason at once, `TrainConfig.validate`) and builds its
schedule, reading a schedule file once; the `PreparedRun` it returns travels to every rank as a
value, so no rank validates again, rebuilds the schedule or re-reads the file. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipesim.schedule.schedule import Schedule

from ..config import TrainConfig


@dataclass(frozen=True)
class PreparedRun:
    """``config`` validated, and the ``schedule`` this run starts with: the config's, or
    (``custom_schedule``) one given as data (a caller's Schedule, zb-auto's profiled first
    order, `pipeexec.run.zb_auto.profiled_start`)."""

    config: TrainConfig
    schedule: Schedule
    custom_schedule: bool = False


def prepare(config: TrainConfig, *, world_size: int | None = None,
            num_layers: int | None = None, schedule: Schedule | None = None) -> PreparedRun:
    """Validate ``config`` for ``world_size`` ranks (``num_layers``: the length of a caller's
    own layer stack) and build its schedule, or check ``schedule`` (any pipesim Schedule run
    instead of the one the config names) against its pp, vpp and microbatches. Raises ConfigError, pipesim.ScheduleError or ValueError with the reason."""
    config.validate(world_size=world_size, num_layers=num_layers, check_schedule=False)
    if schedule is not None:
        got = (schedule.pp, schedule.parts_per_rank, schedule.num_microbatches)
        ours = (config.plan.parallelism.pp, config.plan.parallelism.vpp, config.plan.microbatches)
        if got != ours:
            raise ValueError(f"schedule {schedule.name!r} has pp, vpp, microbatches = {got}, the "
                             f"config {ours}")
        return PreparedRun(config, schedule.validate(), custom_schedule=True)
    return PreparedRun(config, config.build_schedule())
