"""ZeRO's actions in the measured trace, the calibration and `pipeexec compare`, without
processes: the trace's rows built from records by hand, calibration's prices in closed form
(the per-stage mean of the rows' durations), the per-(action, stage) rows' formatting on a
trace written out by hand, and a jittered simulation of a ZeRO-3 schedule dressed as a measured
run predicted back by compare. A run without sharding shows and reports no such rows.

The real run (forked gloo ranks) is tests/exec/test_zero_compare.py.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

import pipesim
from pipeexec.analysis import MeasuredRun, build_trace
from pipeexec.analysis.calibrate import (EXECUTOR_SHARDING_OVERLAP, Layout, calibrate, fit_run,
                                         repartition)
from pipeexec.analysis.compare import compare_runs
from pipeexec.analysis.sharding_rows import (LEGEND, sharding_markdown, sharding_report,
                                             sharding_table, sharding_text)
from pipeexec.cli.compare import write_outputs
from pipeexec.measuring.recorder import ActionRecord
from pipesim.schedule.io import schedule_to_dict
from pipesim.schedule.sharding import Sharding
from pipesim.sim.calibrate import fit_costs

from test_compare import jittered_run

NAN = math.nan
SHARD = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


def rec(step, op, stage, mb, start, end, wait=(NAN, NAN)):
    return ActionRecord(step, op, stage, mb, start, end, wait[0], wait[1], 0, NAN, NAN)


# -- the measured trace ----------------------------------------------------------------------------
def test_build_trace_times_a_collective_from_when_the_rank_was_free_and_a_release_alone():
    s = pipesim.build_schedule("1f1b", pp=1, microbatches=1).with_sharding(Sharding(3))
    assert [str(a) for a in s.actions(0)] == ["0UNSHARD0", "0F0", "0RESHARD0", "0UNSHARD0",
                                              "0B0", "0REDUCE_GRAD0", "0RESHARD0"]
    recs = [rec(0, "UNSHARD", 0, 0, 1.0, 1.5), rec(0, "F", 0, 0, 1.6, 2.0),
            rec(0, "RESHARD", 0, 0, 2.3, 2.4),
            rec(0, "UNSHARD", 0, 0, 2.6, 3.0), rec(0, "B", 0, 0, 3.1, 4.0),
            rec(0, "REDUCE_GRAD", 0, 0, 4.2, 4.5), rec(0, "RESHARD", 0, 0, 4.6, 4.65)]
    t = build_trace([recs], [0.0], s)
    got = [(r.op, pytest.approx(r.start + 1.0), pytest.approx(r.end + 1.0))
           for r in t.itertuples()]
    assert got == [
        ("UNSHARD", 1.0, 1.5),         # the step's first action: from its own start
        ("F", 1.5, 2.0),               # from the gather's end (the executor's work in between)
        ("RESHARD", 2.0, 2.1),         # its own 0.1 s, from when the rank was free
        ("UNSHARD", 2.1, 3.0),         # the executor's work before the RESHARD is here
        ("B", 3.0, 4.0),
        ("REDUCE_GRAD", 4.0, 4.5),
        ("RESHARD", 4.5, 4.55)]
    shard = t[t["op"].isin(SHARD)]
    assert set(shard["kind"]) == {"comm"} and set(shard["peer"]) == {-1}
    assert set(shard["bytes"]) == {0}
    # the step starts at the first gather, as a simulation's
    run = MeasuredRun(t, {"schedule": "1f1b", "pp": 1, "vpp": 1, "microbatches": 1,
                          "bounds": [0, 1], "layer_kinds": ["block"],
                          "schedule_data": schedule_to_dict(s)})
    assert run.makespans() == {0: pytest.approx(3.55)}
    assert run.step_trace(0)["start"].min() == 0.0


# -- calibration ------------------------------------------------------------------------------------
def zero3_run(steps: int = 2) -> tuple[MeasuredRun, pipesim.Schedule, pipesim.CostModel]:
    """A ZeRO-3 zb-h1 (pp 4, m 8) simulated with jittered computations and gathers whose
    durations vary from step to step, dressed as a measured run (times per step, memory)."""
    base = pipesim.build_schedule("zb-h1", pp=4, microbatches=8)
    s = base.with_sharding(Sharding(3, "per_step"))
    n = s.num_stages
    truth = pipesim.CostModel(forward=[1.0 + 0.1 * k for k in range(n)], backward_input=[1.0] * n,
                              backward_weight=[0.8] * n, p2p_latency=0.01, p2p_bandwidth=1e4,
                              p2p_bytes=[50.0] * n, unshard=[0.2, 0.3, 0.25, 0.4],
                              reduce_grad=[0.5, 0.45, 0.6, 0.7], overlap_sharding=0.0)
    frames = []
    for k in range(steps):
        costs = truth.with_(unshard=[u * (1 + 0.1 * k) for u in truth.unshard])
        t = pipesim.simulate(s, costs, jitter=0.04, seed=k, comm="rendezvous").trace.copy()
        t["op"], t["kind"] = t["op"].astype(str), t["kind"].astype(str)
        t["step"] = k
        t["mem_start"], t["mem_end"] = 0.0, 0.0
        t["arrival_observed"] = True
        t["link_start"] = t["start"]
        for col in ("start", "end", "link_start"):
            t[col] += 100.0 * k
        frames.append(t)
    meta = {"schedule": s.name, "pp": 4, "vpp": 1, "microbatches": 8,
            "bounds": list(range(n + 1)), "layer_kinds": ["block"] * n,
            "schedule_data": schedule_to_dict(s), "memory": "synthetic"}
    return MeasuredRun(pd.concat(frames, ignore_index=True), meta), s, truth


def stage_means(trace: pd.DataFrame, op: str, n: int) -> list[float]:
    rows = trace[trace["op"] == op]
    return [float((rows["end"] - rows["start"])[rows["stage"] == s].mean()) for s in range(n)]


def test_calibration_prices_the_sharding_actions_by_their_per_stage_means():
    run, s, truth = zero3_run()
    assert run.schedule.sharding == Sharding(3, "per_step")       # recorded with the run
    costs = fit_run(run)
    # closed form: the mean of the measured rows' durations per stage, over the steps used
    assert costs.stage_values("unshard", 4) == pytest.approx(stage_means(run.trace, "UNSHARD", 4))
    assert costs.stage_values("reduce_grad", 4) == pytest.approx(
        stage_means(run.trace, "REDUCE_GRAD", 4))
    # the gathers took 1x then 1.1x: their mean, not either step's
    assert costs.stage_values("unshard", 4) == pytest.approx([u * 1.05 for u in truth.unshard])
    assert costs.stage_values("reduce_grad", 4) == pytest.approx(truth.reduce_grad)
    assert costs.overlap_sharding == EXECUTOR_SHARDING_OVERLAP == 0.0
    one = calibrate(run, steps=[1]).costs
    assert one.stage_values("unshard", 4) == pytest.approx([u * 1.1 for u in truth.unshard])
    # a run without sharding rows: no price, as before
    plain = fit_run(jittered_run())
    assert plain.unshard == 0.0 and plain.reduce_grad == 0.0


def test_fit_costs_refuses_sharding_rows_on_some_stages_only():
    run, _, _ = zero3_run(steps=1)
    t = run.trace
    t = t[~((t["op"] == "REDUCE_GRAD") & (t["stage"] == 2))]
    with pytest.raises(ValueError, match=r"REDUCE_GRAD .* not for stage\(s\) \[2\]"):
        fit_costs(t, num_stages=4)


def test_repartition_sums_the_sharding_prices_per_layer_kind():
    kinds = ("block",) * 8
    src, dst = Layout((0, 2, 4, 6, 8), kinds), Layout(tuple(range(9)), kinds)
    costs = pipesim.CostModel(forward=[2.0] * 4, backward=[4.0] * 4,
                              unshard=[0.4] * 4, reduce_grad=[0.6] * 4)
    cal = repartition(costs, src, dst)
    assert cal.costs.stage_values("unshard", 8) == pytest.approx([0.2] * 8)
    assert cal.costs.stage_values("reduce_grad", 8) == pytest.approx([0.3] * 8)
    assert cal.per_kind["unshard"] == {"block": pytest.approx(0.2)}
    plain = repartition(costs.with_(unshard=0.0, reduce_grad=0.0), src, dst)
    assert plain.costs.unshard == 0.0 and plain.costs.reduce_grad == 0.0


# -- the rows' formatting, on a trace written out by hand --------------------------------------
def hand_traces() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two measured steps and one predicted (times in binary fractions of a second, exact):
    stage 0 on rank 0, stage 1 on rank 1."""
    def rows(spec, step=None):
        t = pd.DataFrame(spec, columns=["rank", "op", "stage", "start", "end"])
        t["kind"] = np.where(t["op"].isin(SHARD), "comm", "compute")
        if step is not None:
            t["step"] = step
        return t
    m0 = rows([(0, "UNSHARD", 0, 0.0, 0.25), (0, "F", 0, 0.25, 1.0),
               (0, "RESHARD", 0, 1.0, 1.0078125), (1, "UNSHARD", 1, 0.0, 0.5),
               (0, "REDUCE_GRAD", 0, 2.0, 2.5)], step=3)
    m1 = rows([(0, "UNSHARD", 0, 4.0, 4.75), (0, "F", 0, 4.75, 5.5),
               (0, "RESHARD", 0, 5.5, 5.5078125), (1, "UNSHARD", 1, 4.0, 4.5),
               (0, "REDUCE_GRAD", 0, 6.0, 6.5)], step=4)
    other = rows([(0, "UNSHARD", 0, 9.0, 9.5)], step=5)          # not compared
    pred = rows([(0, "UNSHARD", 0, 0.0, 0.5), (0, "F", 0, 0.5, 1.25),
                 (0, "RESHARD", 0, 1.25, 1.25), (1, "UNSHARD", 1, 0.0, 0.5),
                 (0, "REDUCE_GRAD", 0, 2.0, 2.5)])
    return pd.concat([m0, m1, other], ignore_index=True), pred


def test_the_sharding_rows_table_and_its_text_markdown_and_json():
    measured, predicted = hand_traces()
    t = sharding_table(measured, [3, 4], predicted)
    assert [(r.action, r.stage, r.rank) for r in t.itertuples()] == [
        ("UNSHARD", 0, 0), ("UNSHARD", 1, 1), ("RESHARD", 0, 0), ("REDUCE_GRAD", 0, 0)]
    u0 = t.iloc[0]
    assert (u0.count_measured, u0.count_predicted) == (1.0, 1.0)
    assert u0.per_action_measured == 0.5                    # the mean of 0.25 s and 0.75 s
    assert (u0.per_action_predicted, u0.per_action_error) == (0.5, 0.0)
    assert u0.per_step_measured == 0.5
    rs = t.iloc[2]
    assert (rs.per_action_measured, rs.per_action_predicted) == (0.0078125, 0.0)
    assert rs.per_action_error == -1.0
    lines = sharding_text(t)
    assert lines[:3] == [
        "                       |     count     |       per action ms        |        per step ms         |",
        "     action stage rank |   meas   pred |     meas     pred      err |     meas     pred      err |",
        "-" * 98]
    assert lines[3:7] == [
        "    UNSHARD     0    0 |      1      1 |  500.000  500.000    +0.0% |  500.000  500.000    +0.0% |",
        "    UNSHARD     1    1 |      1      1 |  500.000  500.000    +0.0% |  500.000  500.000    +0.0% |",
        "    RESHARD     0    0 |      1      1 |    7.812    0.000  -100.0% |    7.812    0.000  -100.0% |",
        "REDUCE_GRAD     0    0 |      1      1 |  500.000  500.000    +0.0% |  500.000  500.000    +0.0% |"]
    assert lines[7] == LEGEND and len(lines) == 8
    md = sharding_markdown(t)
    assert md[0].startswith("| action | stage | rank | count meas |") and len(md) == 2 + 4
    assert all(line.count("|") == md[0].count("|") for line in md)
    assert md[2] == "| UNSHARD | 0 | 0 | 1 | 1 | 500.000 | 500.000 | +0.0% | 500.000 | 500.000 | +0.0% |"
    report = sharding_report(t)
    assert json.loads(json.dumps(report)) == report
    assert report[0] == {"action": "UNSHARD", "stage": 0, "rank": 0, "count_measured": 1.0,
                         "count_predicted": 1.0, "count_error": 0.0, "per_action_measured": 0.5,
                         "per_action_predicted": 0.5, "per_action_error": 0.0,
                         "per_step_measured": 0.5, "per_step_predicted": 0.5,
                         "per_step_error": 0.0}


def test_a_row_only_one_side_has_shows_n_a_not_a_number():
    measured, predicted = hand_traces()
    t = sharding_table(measured, [3, 4], predicted[predicted["stage"] == 0])
    u1 = t[(t["action"] == "UNSHARD") & (t["stage"] == 1)].iloc[0]
    assert u1.count_predicted == 0.0 and math.isnan(u1.per_action_predicted)
    assert "n/a" in sharding_text(t)[4]
    assert sharding_report(t)[1]["per_action_predicted"] is None
    assert sharding_text(sharding_table(measured[~measured["op"].isin(SHARD)], [3, 4],
                                        predicted[~predicted["op"].isin(SHARD)])) == []


# -- compare, end to end on the synthetic run --------------------------------------------------------
def test_compare_shows_zeros_actions_predicted_vs_measured(tmp_path):
    run, s, truth = zero3_run()
    c = compare_runs(run)
    t = c.sharding_table()
    want = sorted({(a.op, a.stage) for r in range(4) for a in s.actions(r) if a.op in SHARD})
    assert sorted(zip(t["action"], t["stage"])) == want
    for r in t.itertuples():
        program = sum(a.op == r.action and a.stage == r.stage for a in s.actions(r.rank))
        assert r.count_measured == r.count_predicted == program
        if r.action != "RESHARD":                 # priced from the run itself: as measured
            assert r.per_action_predicted == pytest.approx(r.per_action_measured)
            assert r.per_step_predicted == pytest.approx(r.per_step_measured)
    report = c.report()
    assert abs(report["step_time_error"]) < 0.04
    assert report["calibration"]["costs"]["unshard"] == pytest.approx(
        stage_means(run.trace, "UNSHARD", 4))
    assert report["calibration"]["costs"]["overlap_sharding"] == 0.0
    text = c.text()
    assert "\n".join(sharding_text(t)) in text and "UNSHARD" in text
    files = write_outputs(c, report_out=str(tmp_path / "r.json"), table_out=str(tmp_path / "t.md"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["sharding_actions"] == sharding_report(t)
    assert [(a["action"], a["stage"]) for a in saved["sharding_actions"]] == [
        (op, st) for op in SHARD for st in range(4)]
    md = (tmp_path / "t.md").read_text()
    assert "\n".join(sharding_markdown(t)) in md and files["report"] == str(tmp_path / "r.json")
    write_outputs(c, table_out=str(tmp_path / "t.csv"))
    csv = pd.read_csv(tmp_path / "t.csv", dtype={"rank": str})
    shard = csv[csv["row"] == "sharding"].reset_index(drop=True)
    assert list(csv["row"]) == ["rank"] * 5 + ["sharding"] * len(t)
    assert list(zip(shard["action"], shard["stage"].astype(int), shard["rank"])) == [
        (r.action, r.stage, str(r.rank)) for r in t.itertuples()]
    for col in t.columns[3:]:
        assert shard[col].tolist() == pytest.approx(t[col].tolist(), rel=1e-12, nan_ok=True)


def test_a_run_without_sharding_shows_and_reports_none(tmp_path):
    c = compare_runs(jittered_run())
    assert len(c.sharding_table()) == 0
    assert "sharding_actions" not in c.report()
    assert "unshard" not in c.report()["calibration"]["costs"]
    assert "UNSHARD" not in c.text() and "REDUCE_GRAD" not in c.markdown()
    write_outputs(c, table_out=str(tmp_path / "t.csv"))
    csv = pd.read_csv(tmp_path / "t.csv", dtype={"rank": str})
    assert set(csv["row"]) == {"rank"} and "action" not in csv.columns
    assert list(csv["rank"]) == ["0", "1", "2", "3", "all"]
