"""Measured runs: time every action, align clocks, count memory, gather a pipesim trace, then
calibrate a CostModel from it and compare prediction with measurement.

One module per idea: `recorder` (the runtime's action timer and the receive-wait probe),
`clock` (offsets to rank 0), `memory` (held-tensor and allocator meters), `measured` (the
gathered trace and `MeasuredRun`), `session` (wiring a profiled training run), `calibrate`
(costs from a measured run, re-partitioned if needed), `contention` (ranks sharing cores:
processor sharing around the simulator), `predict` (simulating a layout with calibrated costs),
`run_description` (what a calibration run was, and matching a new run against it), `paired`
(a calibration schedule and its target in one job, alternating steps),
`compare` (prediction vs measurement: the table and report), `compare_cli` (``pipeexec
compare``: a profiled run, its comparison and output files), `overlay` (predicted and measured
Gantt charts on one time axis).
"""
from __future__ import annotations

from .calibrate import fit_run
from .clock import ClockAlignmentError, ClockOffset, align_clocks
from .compare import compare_runs
from .predict import layout_of, predict
from .measured import MeasuredRun, build_trace
from .recorder import ActionProfiler, ActionRecord, ProfiledP2P
from .session import ProfileOptions, ProfileSession, parse_step_range

__all__ = ["ActionProfiler", "ActionRecord", "ClockAlignmentError", "ClockOffset",
           "MeasuredRun", "ProfileOptions", "ProfileSession", "ProfiledP2P", "align_clocks",
           "build_trace", "compare_runs", "fit_run", "layout_of", "parse_step_range", "predict"]
