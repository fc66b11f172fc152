"""The comparison table's "all" row on hand-written traces: one rank's figures a side (the
busiest), adding up to the step, and named; and relative errors of a zero makespan printed as
n/a, never "+inf%"."""
from __future__ import annotations

import math

import pandas as pd
import pytest

import pipesim
from pipeexec.analysis import MeasuredRun
from pipeexec.analysis.calibrate import Calibration
from pipeexec.analysis.compare import Comparison, compare_runs
from pipesim.sim.result import SimResult

from test_compare import jittered_run

# 1f1b, pp 2, one microbatch: (rank, op, start, end); stage = rank. Measured, two steps: by the
# steps' means rank 1 is the busiest (4.25 s against 4.0) and rank 0 the slowest (the larger
# idle share of its own span), while step 0 alone has rank 0 the busiest. Predicted: the other
# way round (rank 0 the busiest, rank 1 the slowest).
MEASURED = {0: [(0, "F", 0, 3), (1, "F", 3, 4), (1, "B", 6, 7), (0, "B", 7, 10)],
            1: [(0, "F", 0, 1), (1, "F", 1, 4), (1, "B", 4.5, 8), (0, "B", 8, 9)]}
PREDICTED = [(0, "F", 0, 3), (1, "F", 3, 4), (1, "B", 6, 7), (0, "B", 7, 10)]


def frame(rows, step=0, offset=0.0) -> pd.DataFrame:
    return pd.DataFrame([
        {"rank": r, "op": op, "stage": r, "chunk": 0, "microbatch": 0, "start": a + offset,
         "end": b + offset, "kind": "compute", "bytes": 0, "peer": -1, "step": step,
         "mem_start": 0.0, "mem_end": 1.0, "arrival_observed": False,
         "link_start": math.nan, "compute_start": a + offset, "cpu": math.nan}
        for r, op, a, b in rows])


def hand_comparison() -> Comparison:
    meta = {"schedule": "1f1b", "pp": 2, "vpp": 1, "microbatches": 1, "bounds": [0, 1, 2],
            "layer_kinds": ["block", "block"]}
    trace = pd.concat([frame(rows, s, 20.0 * s) for s, rows in MEASURED.items()],
                      ignore_index=True)
    run = MeasuredRun(trace, meta)
    predicted = SimResult.from_trace(frame(PREDICTED), schedule=run.schedule)
    cal = Calibration(costs=pipesim.CostModel(forward=1.0), source={
        "schedule": "1f1b", "bounds": [0, 1, 2]})
    return Comparison(run.result(0), predicted, cal, run, 0, [0, 1])


def busy_and_makespan(rows) -> tuple[list[float], float]:
    busy = [sum(b - a for r, _, a, b in rows if r == k) for k in (0, 1)]
    return busy, max(b for *_, b in rows) - min(a for _, _, a, _ in rows)


def test_the_all_row_is_the_busiest_ranks_figures_and_adds_up_to_the_step():
    c = hand_comparison()
    per_step = [busy_and_makespan(rows) for rows in MEASURED.values()]
    mean_busy = [sum(b[k] for b, _ in per_step) / 2 for k in (0, 1)]       # [4.0, 4.25]
    step = sum(s for _, s in per_step) / 2                                 # 9.5
    pred_busy, pred_step = busy_and_makespan(PREDICTED)                     # [6, 2], 10
    assert mean_busy == [4.0, 4.25] and pred_busy == [6, 2]
    # the ranks differ: the busiest is not the slowest, on either side
    assert c.slowest_ranks() == (0, 1)
    row = c.table().loc["all"]
    for side, busy, span in (("measured", 4.25, step), ("predicted", 6.0, pred_step)):
        assert row[f"finish_{side}"] == pytest.approx(span)
        assert row[f"busy_{side}"] == pytest.approx(busy)
        assert row[f"busy_{side}"] + row[f"bubble_{side}"] == pytest.approx(row[f"finish_{side}"])
        assert row[f"idle_over_busy_{side}"] == pytest.approx(
            row[f"bubble_{side}"] / row[f"busy_{side}"])
    # predicted: exactly pipesim's bubble_fraction of the predicted step
    assert row["idle_over_busy_predicted"] == pytest.approx(c.predicted.bubble_fraction)
    assert row["idle_over_busy_error"] == pytest.approx((10 - 6) / 6 - (9.5 - 4.25) / 4.25)
    # and it says whose figures they are
    assert c.step_ranks() == (1, 0)
    assert c.table().attrs["step_ranks"] == {"measured": 1, "predicted": 0}
    assert c.report()["step_ranks"] == {"measured": 1, "predicted": 0}
    assert "busiest rank's figures (rank 1 measured, rank 0 predicted)" in c.text()
    assert "| all (rank 1 meas, rank 0 pred) | 9500.0 |" in c.markdown()


def test_the_all_row_of_a_simulated_run_adds_up_and_is_pipesims_bubble_fraction():
    c = compare_runs(jittered_run(steps=4))
    t = c.table()
    ranks, row = t.drop(index="all"), t.loc["all"]
    for side in ("measured", "predicted"):
        assert row[f"busy_{side}"] == pytest.approx(ranks[f"busy_{side}"].max())
        assert row[f"busy_{side}"] + row[f"bubble_{side}"] == pytest.approx(row[f"finish_{side}"])
    assert row["idle_over_busy_predicted"] == pytest.approx(c.predicted.bubble_fraction)


def test_a_zero_makespan_reads_n_a_in_the_headline_and_the_figure_title():
    c = compare_runs(jittered_run(steps=4))
    c._overall["makespan"] = 0.0                    # the compared steps' mean
    assert "n/a; the pipeline's makespan" in c.headline() and "inf" not in c.headline()
    c.measured.__dict__["makespan"] = 0.0           # the pictured step (a cached property)
    fig = c.figure()
    title = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    title += " ".join(ax.get_title(loc=loc) for ax in fig.axes for loc in ("left", "center"))
    assert "0.0 ms (n/a)" in title and "mean 0.0 ms: n/a" in title
    assert "inf" not in title and "nan" not in title
