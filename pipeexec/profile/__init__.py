"""Measured runs: time every action, align clocks, count memory, gather a pipesim trace, then
calibrate a CostModel from it and compare prediction with measurement.

One module per idea: `run_plan` (what the run was: schedule as data, partition, layer kinds,
hosts and CPU shares; torch-free), `recorder` (the runtime's action timer and the receive-wait probe),
`clock` (offsets to rank 0), `memory` (held-tensor and allocator meters), `measured` (the
gathered trace and `MeasuredRun`), `session` (wiring a profiled training run), `calibrate`
(costs from a measured run, re-partitioned if needed), `contention` (ranks sharing cores:
processor sharing around the simulator), `predict` (simulating a layout with calibrated costs), `plan_memory` (activation peaks
predicted from the plan alone, no run),
`run_description` (what a calibration run was, and matching a new run against it), `paired`
(a calibration schedule and its target in one job, alternating steps),
`compare` (prediction vs measurement: the table and report), `compare_cli` (``pipeexec
compare``: a profiled run, its comparison and output files), `overlay` (predicted and measured
Gantt charts on one time axis).
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# The measuring room is torch-free and imported here (``predict`` the function shadows the
# submodule of that name, as it always did); recorder, clock and session, which run inside the
# workers and need torch, resolve on first use (PEP 562).
from .calibrate import fit_run
from .compare import compare_runs
from .measured import MeasuredRun, build_trace
from .predict import layout_of, predict, prediction_costs
from .run_plan import Layout, RunPlan

_LAZY = {"ClockAlignmentError": "clock", "ClockOffset": "clock", "align_clocks": "clock",
         "ActionProfiler": "recorder", "ActionRecord": "recorder", "ProfiledP2P": "recorder",
         "ProfileOptions": "options", "ProfileSession": "session",
         "parse_step_range": "options"}

__all__ = sorted(["Layout", "MeasuredRun", "RunPlan", "build_trace", "compare_runs", "fit_run",
                  "layout_of", "predict", "prediction_costs", *_LAZY])

if TYPE_CHECKING:
    from .clock import ClockAlignmentError, ClockOffset, align_clocks
    from .recorder import ActionProfiler, ActionRecord, ProfiledP2P
    from .options import ProfileOptions, parse_step_range
    from .session import ProfileSession


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipeexec.profile' has no attribute {name!r}")
