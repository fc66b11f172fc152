"""zb-auto searched from the run's own steps (``--memory-limit``): the per-step callback that
profiles, switches, measures the replaced order again and keeps the faster, and what it adds
to the run's metrics. The search and the judgement are `pipeexec.measuring.reschedule`'s."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..config import RESCHEDULE_WARMUP_STEPS, TrainConfig
from ..measuring.reschedule import judge_switch, profiled_schedule, reschedule, trial_steps
from ..measuring.session import ProfileSession
from .prepare import PreparedRun


def profiled_start(run: PreparedRun) -> PreparedRun:
    """``run`` starting on the order its first steps are profiled with (F, I and W timed
    apart on the stages the search keeps), the order zb-auto searches from."""
    return dataclasses.replace(run, schedule=profiled_schedule(run.config), custom_schedule=True)


class ZbAutoSwitch:
    """The ``on_step`` of a zb-auto run: at step ``switch_at`` it searches and switches, then
    runs the replaced order for as many trial steps again and keeps the switch only if it was
    measured faster by the margin. ``then``: the callback it wraps (a checkpoint manager's)."""

    def __init__(self, config: TrainConfig, session: ProfileSession,
                 then: Callable[[Any, Any], None] | None, log: Callable[[str], None]) -> None:
        self.memory_limit, self.session, self.then, self.log = (config.layout.memory_limit, session,
                                                                then, log)
        self.switch_at = RESCHEDULE_WARMUP_STEPS + config.layout.reschedule_after
        self.trial = trial_steps(config.optimizer.steps, self.switch_at)
        self.baseline_at = self.switch_at + self.trial
        self.judge_at = self.switch_at + 2 * self.trial
        self.switched: dict[str, Any] = {}
        self.times: dict[int, float] = {}
        self.orders: list = []

    def __call__(self, trainer: Any, stats: Any) -> None:
        if self.then is not None:
            self.then(trainer, stats)
        self.times[stats.iteration] = stats.step_time
        if trainer.iteration == self.switch_at:
            replaced = trainer.schedule
            self.switched.update(reschedule(trainer, self.session, self.memory_limit, self.log))
            self.orders[:] = [replaced, trainer.schedule]
        elif self.trial and trainer.iteration == self.baseline_at:
            trainer.set_schedule(self.orders[0])      # the replaced order, measured again
        elif self.trial and trainer.iteration == self.judge_at:
            # kept only if measured faster than the order it replaced, by the margin
            judge_switch(trainer, self.switched,
                         [self.times[k] for k in range(self.switch_at, self.baseline_at)],
                         [self.times[k] for k in range(self.baseline_at, self.judge_at)],
                         *self.orders, self.log)

    def metrics(self, trainer: Any, step_times: list[float], *, rank: int) -> dict[str, Any]:
        """The run's ``reschedule`` metrics; rank 0 logs the step time measured after it."""
        after = step_times[self.switch_at:]
        settled = step_times[self.judge_at:] if self.trial else after
        if rank == 0 and settled:
            self.log(f"zb-auto: measured {sorted(settled)[len(settled) // 2] * 1e3:.1f} ms a "
                     f"step on {trainer.schedule.name} "
                     + ("after the trial" if self.trial else "after the switch")
                     + f" (median of {len(settled)} steps' step_time, the optimizer included; "
                     f"the searched order was predicted {self.switched['predicted_s'] * 1e3:.1f} "
                     "ms of pipeline from the profiled steps' costs, which carry the profiler's "
                     "overhead: compare the profiled steps' measured and predicted above)")
        return dict(self.switched, measured_after_s=after, final_schedule=trainer.schedule.name)
