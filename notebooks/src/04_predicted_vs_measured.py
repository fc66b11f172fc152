# %% [markdown]
# # 04 · Predicted vs measured
#
# The point of having one schedule and two backends: measure one real run, fit the
# simulator's costs to it, predict *other* schedules before running them, then run them and
# put prediction and measurement side by side.
#
# 1. **Profile** a 1F1B and a ZB-H1 run of the built-in GPT: every action of every rank is
#    timed, the ranks' clocks aligned, activation memory counted, and one trace gathered
#    (`pipeexec compare`, or `pipeexec train --profile A:B --trace-out FILE`).
# 2. **Calibrate**: per-layer forward, backward, input- and weight-gradient times and
#    activation bytes, fitted to those traces, re-cut for any other layout.
# 3. **Predict** GPipe, ZB-H2, interleaved 1F1B and ZB-V with `pipesim`, before running them.
# 4. **Run** them for real, profiled, and compare: a table and predicted-over-measured Gantt charts.
#
# This machine has 2 CPU cores, shared, so the runs use `pp = 2` ranks (one core each) and a
# model big enough that compute outweighs Python overhead. The simulator assumes every rank
# owns its device; on a shared CPU a rank can be descheduled at any moment, so expect errors
# of tens of percent here, and much less on dedicated GPUs. Every figure says which world
# (**predicted** or **measured**) it shows.

# %%
%matplotlib inline
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

import pipesim
from pipeexec import TrainConfig
from pipeexec.analysis import MeasuredRun, compare_runs, fit_run, layout_of, predict

pd.set_option("display.width", 160)
pd.set_option("display.precision", 3)
WORK = Path(tempfile.mkdtemp(prefix="pipeexec-compare-"))
PP, M, STEPS = 2, 8, 6          # steps 1..5 are profiled; step 0 warms up
MODEL = dict(layers=6, hidden=128, heads=4, seq_len=64)
SCHEDULES = {"1f1b": 1, "gpipe": 1, "zb-h1": 1, "zb-h2": 1, "interleaved": 2, "zbv": 2}


def flags(name, vpp):
    out = ["--schedule", name, "--pp", str(PP), "--vpp", str(vpp), "--microbatches", str(M),
           "--steps", str(STEPS), "--no-progress"]
    for key, value in MODEL.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def pipeexec_compare(name, vpp, *extra):
    """``pipeexec compare`` one schedule; keep its trace and report; return the report."""
    cmd = [sys.executable, "-m", "pipeexec", "compare", *flags(name, vpp),
           "--trace-out", f"{name}.json", "--report-out", f"{name}.report.json", *extra]
    print("$ pipeexec compare " + " ".join(cmd[4:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=WORK, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"pipeexec compare failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [l for l in proc.stdout.splitlines() if not l.startswith(("step ", "wrote ", "pipeexec: "))]
    print("\n".join(lines))
    print(f"({time.perf_counter() - t0:.1f} s wall clock)\n")
    return json.loads((WORK / f"{name}.report.json").read_text())

# %% [markdown]
# ## 1. Profile two calibration runs
#
# `pipeexec compare` trains a schedule with profiling on, then simulates the very same
# schedule with costs calibrated from that run: the question it answers is whether the
# simulator reproduces a step from its per-stage costs alone. We profile two schedules:
# 1F1B, whose backward is one full `B` per stage and microbatch, and ZB-H1, whose backward
# is split into the input gradient `I` and the weight gradient `W`.

# %%
reports = {"1f1b": pipeexec_compare("1f1b", 1), "zb-h1": pipeexec_compare("zb-h1", 1)}
calibration_runs = {name: MeasuredRun.load(WORK / f"{name}.json") for name in reports}
for name, run in calibration_runs.items():
    print(f"{name}: profiled steps {run.steps}, measured step times (ms):",
          {k: round(v * 1e3, 1) for k, v in run.makespans().items()})

# %% [markdown]
# The two runs' per-stage costs (means over the profiled steps) show why two are needed:
# `I + W` is not `B`. On the first stage the input gradient is almost free (nothing before
# the embedding needs it); on the others the executor's split backward does more work than
# the full one (`I` keeps the autograd graph for `W`, and walks it twice), so costs fitted
# to a run with only `B` would mispredict the Zero Bubble schedules' compute.

# %%
fitted = {name: fit_run(run).compute_times(PP) for name, run in calibration_runs.items()}
costs_table = pd.DataFrame({
    "F, 1f1b run": fitted["1f1b"]["F"], "B, 1f1b run": fitted["1f1b"]["B"],
    "F, zb-h1 run": fitted["zb-h1"]["F"], "I, zb-h1 run": fitted["zb-h1"]["I"],
    "W, zb-h1 run": fitted["zb-h1"]["W"]}, index=pd.Index(range(PP), name="stage")) * 1e3
costs_table["(I + W) / B"] = (costs_table["I, zb-h1 run"] + costs_table["W, zb-h1 run"]) / costs_table["B, 1f1b run"]
print("measured mean cost of one action (ms)")
costs_table

# %% [markdown]
# ## 2. Calibrate, and predict the other schedules before running them
#
# Each prediction takes its costs from the calibration run with the same kind of backward:
# GPipe and interleaved 1F1B from the 1F1B run, ZB-H2 and ZB-V from the ZB-H1 run. The
# calibration fits per-layer-kind costs (embedding, transformer block, head), so it can
# re-cut them for a layout with other stage boundaries (the 4 stages of `vpp = 2`).
# A computation also pays a fixed cost per action that does not scale with its layers (the
# executor's work between actions: posting sends and receives, bookkeeping); `vpp = 2` runs
# twice the actions, so that part is charged once per target stage, not divided by layers.
# Stages of equal size cannot tell what the computation itself spends per action apart from
# its layers' share, so that part is still re-cut per layer: predictions for `vpp = 2` from a
# `vpp = 1` run stay on the short side at this small size.

# %%
SOURCE = {"1f1b": "1f1b", "zb-h1": "zb-h1", "gpipe": "1f1b", "interleaved": "1f1b",
          "zb-h2": "zb-h1", "zbv": "zb-h1"}
predictions = {}
for name, vpp in SCHEDULES.items():
    config = TrainConfig.from_flat(schedule=name, pp=PP, vpp=vpp, microbatches=M, **MODEL)
    predictions[name], _ = predict(config.build_schedule(), layout_of(config),
                                   calibration_runs[SOURCE[name]])
before = pd.DataFrame({
    name: {"vpp": SCHEDULES[name], "calibrated from": f"{SOURCE[name]} run",
           "predicted step (ms)": r.makespan * 1e3,
           "predicted bubble_fraction": r.bubble_fraction,
           "predicted peak activations (MiB)": max(r.peak_memory) / 2**20}
    for name, r in predictions.items()}).T.sort_values("predicted step (ms)")
before.astype({"vpp": int, "predicted step (ms)": float, "predicted bubble_fraction": float,
               "predicted peak activations (MiB)": float})

# %% [markdown]
# ## 3. Run them, profiled, and compare
#
# `--calibrate-from` makes `pipeexec compare` predict from a calibration run's trace instead
# of the run itself: a prediction made without any of this run's timings.

# %%
for name, vpp in SCHEDULES.items():
    if name not in reports:
        reports[name] = pipeexec_compare(name, vpp, "--calibrate-from", f"{SOURCE[name]}.json")

# %%
MiB = 2**20
table = pd.DataFrame({
    name: {"vpp": SCHEDULES[name],
           "predicted step (ms)": r["predicted_step_time"] * 1e3,
           "measured step (ms)": r["measured_step_time"] * 1e3,
           "step error": f"{r['step_time_error']:+.0%}",
           "predicted bubble_fraction": r["predicted_bubble_fraction"],
           "measured bubble_fraction": r["measured_bubble_fraction"],
           "predicted peak act. (MiB)": max(r["predicted_peak_memory"]) / MiB,
           "measured peak act. (MiB)": max(r["measured_peak_memory"]) / MiB,
           "calibrated from": "itself" if SOURCE[name] == name else f"{SOURCE[name]} run"}
    for name, r in ((name, reports[name]) for name in SCHEDULES)}).T
table = table.astype({"vpp": int, "predicted step (ms)": float, "measured step (ms)": float,
                      "predicted bubble_fraction": float, "measured bubble_fraction": float,
                      "predicted peak act. (MiB)": float, "measured peak act. (MiB)": float})
table

# %% [markdown]
# Two things make a prediction from another run miss: the machine itself drifting between
# runs (on a shared CPU, another process takes a core and every action gets slower), and
# the simulator's model of the schedule (ordering, waits, transfers). Re-simulating each run
# with costs calibrated from *its own* measured steps removes the first: what is left is
# the second. `busy drift` is the slowest rank's measured compute time over the predicted
# one; far from 1, the machine was not the same machine (or the costs came from a run with
# another kind of backward).

# %%
own = {}
for name in SCHEDULES:
    run = MeasuredRun.load(WORK / f"{name}.json")
    own[name] = compare_runs(run)          # its central steps' means, from their own costs
split = pd.DataFrame({
    name: {"calibrated from": f"{SOURCE[name]} run",
           "measured step (ms)": reports[name]["measured_step_time"] * 1e3,
           "predicted (ms)": reports[name]["predicted_step_time"] * 1e3,
           "error": reports[name]["step_time_error"],
           "busy drift": own[name].table().loc["all", "busy_measured"] / max(predictions[name].busy),
           "from own trace (ms)": own[name].predicted.makespan * 1e3,
           "error from own trace": own[name].report()["step_time_error"]}
    for name in SCHEDULES}).T
split.style.format({"measured step (ms)": "{:.1f}", "predicted (ms)": "{:.1f}",
                    "from own trace (ms)": "{:.1f}", "busy drift": "{:.2f}",
                    "error": "{:+.0%}", "error from own trace": "{:+.0%}"})

# %%
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
order = list(table.index)                    # one order for every bar: a schedule's bars together
assert list(split.index) == order, (list(split.index), order)
x = range(len(order))
ax.bar([i - 0.27 for i in x], table["predicted step (ms)"], 0.27, label="predicted (calibration run)",
       color="#6fa8dc")
ax.bar(list(x), split.loc[order, "from own trace (ms)"], 0.27, label="re-simulated from its own trace",
       color="#b4cfe9")
ax.bar([i + 0.27 for i in x], table["measured step (ms)"], 0.27, label="measured", color="#3b75af")
ax.set_xticks(list(x), table.index)
ax.set_ylabel("step time (ms)")
ax.set_title(f"pipeline step time, pp={PP}, m={M}, 2 shared CPU cores", fontsize=10)
ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
ax2.bar([i - 0.2 for i in x], table["predicted peak act. (MiB)"], 0.4, label="predicted", color="#93c47d")
ax2.bar([i + 0.2 for i in x], table["measured peak act. (MiB)"], 0.4, label="measured", color="#4a9a52")
ax2.set_xticks(list(x), table.index)
ax2.set_ylabel("peak activation memory (MiB, worst rank)")
ax2.set_title("peak activation memory", fontsize=10)
ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
fig.tight_layout()

# %% [markdown]
# ## Overlaid Gantt charts
#
# Predicted (top) over measured (bottom), on one time axis, for two predictions made
# from the ZB-H1 run. The lanes under each rank are its transfers and its waits on a receive.
# What the simulator can't know shows up as stretched boxes and extra gaps in the measured
# chart: a rank losing its core to another process, Python overhead between actions, gloo's
# send/receive over loopback TCP.

# %%
comparisons = {}
for name in ("zb-h2", "zbv"):
    run = MeasuredRun.load(WORK / f"{name}.json")
    comparisons[name] = compare_runs(run, calibration_runs[SOURCE[name]])
    display(comparisons[name].figure())
comparisons["zbv"].table()

# %% [markdown]
# ## Checked
#
# Timing on a shared 2-core machine is noisy, so the checks are on what must hold whatever
# the load: every measured step ran exactly the schedule's actions, memory (which does not
# depend on timing) is predicted closely, and the time the simulator gives each rank's
# compute is the calibrated costs' sum.

# %%
for name, r in reports.items():
    pred, meas = max(r["predicted_peak_memory"]), max(r["measured_peak_memory"])
    assert abs(pred - meas) / meas < 0.3, (name, pred, meas)
for name, comp in comparisons.items():
    s = comp.measured.schedule
    measured_actions = (comp.measured.trace["kind"] == "compute").sum()
    assert measured_actions == sum(len(s.compute_order(r)) for r in range(s.pp)), name
assert all(r["measured_step_time"] > 0 and r["predicted_step_time"] > 0 for r in reports.values())
errors = pd.Series({n: r["step_time_error"] for n, r in reports.items()})
print("step-time error of each prediction (predicted / measured - 1):",
      ", ".join(f"{n} {e:+.0%}" for n, e in errors.items()))
own_errors = split["error from own trace"].astype(float)
print("re-simulated from each run's own trace:",
      ", ".join(f"{n} {e:+.0%}" for n, e in own_errors.items()))
print(f"median absolute error {errors.abs().median():.0%} (from a calibration run), "
      f"{own_errors.abs().median():.0%} (from its own trace); peak activation memory within "
      f"{max(abs(max(r['predicted_peak_memory']) / max(r['measured_peak_memory']) - 1) for r in reports.values()):.0%}")
