"""Prediction before running: simulate a schedule with costs calibrated from a measured run.

`layout_of` says how a config will cut the model, without running it; `predict` calibrates
costs for that layout from a measured run (re-partitioned when the cut differs) and simulates.
The simulation moves messages as the executor does (``EXECUTOR_COMM``, pipesim's
``comm="rendezvous"``): gloo and NCCL start a transfer only once the receiver has posted its
receive, which the runtime does where the schedule's RECV stands (``recv_lookahead``
computations before the one that needs the data; with 0, every message between ranks costs
its receiver the transfer time). Simulating sends as starting at once (``"async"``) hid those
waits and ran short, most for schedules with many cross-rank messages per step (interleaved,
ZB-V).

Costs are the calibration run's per-stage wall-time means, unless the calibration run's ranks competed for cores (a CPU run with more
ranks than cores and no ``--cpus-per-rank``): then they are its CPU work per (op, stage), and
the simulation shares the run's effective cores (:mod:`pipeexec.analysis.contention`) among the
ranks computing at each moment, since how much each computation is slowed depends on the
schedule.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pipesim

from .calibrate import Calibration, Layout, calibrate, has_cpu_times
from .contention import effective_cores, shares_cores
from .measured_run import MeasuredRun
from ..models import layer_stack
from ..partition import stage_bounds

if TYPE_CHECKING:
    from pipesim import SimResult

# How pipeexec's transports move a message: gloo (and NCCL) start a point-to-point transfer only
# once the receiver has posted its receive (at the schedule's RECV action).
EXECUTOR_COMM = "rendezvous"
# How pipeexec runs ZeRO's UNSHARD / REDUCE_GRAD (`pipeexec.training.zero`): each one collective
# of a whole stage on the compute stream, the rank waiting for it (`pipesim.CostModel`)
EXECUTOR_SHARDING = {"overlap_sharding": 0.0}


def predict(schedule: "pipesim.Schedule", layout: Layout, calibration_run: MeasuredRun,
            steps: list[int] | None = None, *, contention: bool | None = None,
            comm: str = EXECUTOR_COMM, carry: Callable[[Calibration], Calibration] | None = None
            ) -> tuple["SimResult", Calibration]:
    """Simulate ``schedule`` cut as ``layout`` with costs calibrated on ``calibration_run``
    (its ``steps``, default its `central_steps`): the prediction before (or without) running
    it.

    ``comm``: the simulator's communication mode (``pipesim.simulate``); by default the
    executor's rendezvous, where a transfer starts when both sides have posted. ``carry``: a
    change of the calibrated costs before simulating (to another tp:
    `pipeexec.analysis.tensor_parallel.carry_to_layout`).

    ``contention`` (default: when the calibration run recorded CPU work, i.e. on CPU, and its
    ranks competed for cores, `contention.shares_cores`): model ranks sharing cores. Costs are
    then the CPU work per (op, stage), and the simulation shares the calibration run's
    effective core count among the ranks computing at each moment of the *target* schedule
    (``pipesim.simulate(cores=...)``, processor sharing); otherwise per-stage wall-time means.
    """
    cal = prediction_costs(layout, calibration_run, steps, contention=contention)
    if carry is not None:
        cal = carry(cal)
    return pipesim.simulate(schedule, cal.costs, comm=comm, cores=cal.cores), cal


def prediction_costs(layout: Layout, calibration_run: MeasuredRun,
                     steps: list[int] | None = None, *, contention: bool | None = None
                     ) -> Calibration:
    """The calibration `predict` simulates with: ``costs`` for ``layout``, and ``cores`` (None
    unless the ranks share cores), so that a search (zb-auto's ``cores=``) ranks candidate
    schedules as they will be predicted."""
    if steps is None:
        steps = calibration_run.central_steps()
    if contention is None:
        contention = has_cpu_times(calibration_run) and shares_cores(calibration_run.plan)
    if not contention:
        return calibrate(calibration_run, layout, steps)
    cal = calibrate(calibration_run, layout, steps, work=True)
    trace = calibration_run.trace
    cal.model, cal.cores = "processor-sharing", effective_cores(trace[trace["step"].isin(steps)])
    return cal


def program_of(config: Any) -> "pipesim.Schedule":
    """The program ``config`` runs, without running it: its schedule, lowered with ZeRO-2/3's
    sharding where its gradient holder shards (`pipeexec.training.holder.gradient_holder`:
    ZeRO with more than one data-parallel replica over dp x cp, or expert parallelism), so
    that a prediction before the run times the UNSHARD / RESHARD / REDUCE_GRAD it will run."""
    from pipesim.schedule.sharding import Sharding

    schedule = config.build_schedule()
    par = config.plan.parallelism
    if par.zero and (par.dp * par.cp > 1 or par.ep > 1):
        return schedule.with_sharding(Sharding(par.zero, par.grad_reduce))
    return schedule


def layout_of(config: Any, spec: Any = None) -> Layout:
    """The layout ``config`` will cut ``spec`` (default: the model ``config`` trains, `pipeexec.models.layer_stack`) into,
    computed without running, by the Trainer's own `partition.stage_bounds`."""

    if spec is None:
        spec = layer_stack(config)
    return Layout(stage_bounds(spec, config), tuple(spec.kinds()))
