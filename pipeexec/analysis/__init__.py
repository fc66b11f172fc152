"""What a measured run was and what it says, on any machine (torch-free): the run's description
(`run_plan`), the gathered trace (`measured_run`) with what profiling adds to it
(`profile_meta`), costs calibrated from it (`calibrate`), ranks sharing cores (`contention`),
prediction with those costs (`predict`), activation peaks from the plan alone (`plan_memory`),
matching a calibration run (`run_description`), prediction vs measurement (`compare`) and the
predicted/measured Gantt overlay (`overlay`)."""
from __future__ import annotations

from .calibrate import fit_run
from .compare import compare_runs
from .measured_run import MeasuredRun, build_trace
from .predict import layout_of, predict, prediction_costs
from .run_plan import Layout, RunPlan

__all__ = ["Layout", "MeasuredRun", "RunPlan", "build_trace", "compare_runs", "fit_run",
           "layout_of", "predict", "prediction_costs"]
