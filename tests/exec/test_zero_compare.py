"""ZeRO's actions timed, priced and compared on a real run: the fast test (2 forked gloo ranks,
pp 1 x dp 2, 2 steps, the tiny GPT; ZeRO-3 and ZeRO-2, once a step and once a microbatch).

* The measured trace holds exactly the program's sharding actions: per step, the rank's
  UNSHARD / RESHARD / REDUCE_GRAD rows in time order are the lowered program's, and its
  computations and sharding actions together follow the program's order;
* calibration from the run prices ``unshard`` / ``reduce_grad`` per stage at the mean of
  the measured rows' durations (closed form), blocking, as the executor runs them;
* ``compare``'s rows: a row per (action, stage) of the program, counts as the program's, the
  own trace's prices as measured; in the text, the markdown, the JSON report and the
  ``--table-out`` CSV (its ``sharding`` rows: `sharding_rows.sharding_table`'s figures).
"""
from __future__ import annotations

import functools
import json

import pandas as pd
import pytest

from pipeexec import launch
from pipeexec.analysis.calibrate import fit_run
from pipeexec.analysis.compare import compare_runs
from pipeexec.analysis.predict import program_of
from pipeexec.analysis.sharding_rows import (QUANTITIES, sharding_report, sharding_table,
                                             sharding_text)
from pipeexec.cli.compare import write_outputs
from pipesim.schedule.sharding import Sharding

from exec_helpers import layout_config

SHARD = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
COMPUTE = ("F", "B", "I", "W")
CASES = [("zbv", 3, "per_step"), ("zbv", 2, "per_microbatch"), ("1f1b", 2, "per_step")]


def worker(board):
    from pipeexec.measuring.profile_options import ProfileOptions
    from pipeexec.measuring.session import ProfileSession
    from pipeexec.run.assemble import assemble
    from pipeexec.topology import destroy_topology, init_topology
    from pipeexec.training.train import train

    topo = init_topology(1, 2, device="cpu", timeout=120)
    out = {}
    try:
        for schedule, zero, reduce in CASES:
            cfg = layout_config(schedule, 1, 2, zero=zero, grad_reduce=reduce, steps=2)
            session = ProfileSession(ProfileOptions(0, 2, align_rounds=2, probe_split=False),
                                     topo)
            trainer = assemble(cfg, topo, board=board, recorder=session.profiler)
            session.attach(trainer)
            train(trainer)
            out[(schedule, zero, reduce)] = session.finish(trainer)
    finally:
        destroy_topology(topo)
    return out


@functools.lru_cache(maxsize=None)
def runs():
    got = launch(worker, 2, (), timeout=300)
    assert all(r is None for other in got[1:] for r in other.values())   # rank 0 gathers
    return got[0]


def names(rows) -> list[str]:
    return [f"{s}{op}{mb}" for op, s, mb in zip(rows["op"], rows["stage"], rows["microbatch"])]


@pytest.mark.parametrize("schedule,zero,grad_reduce", CASES)
def test_the_measured_trace_holds_exactly_the_programs_sharding_actions(schedule, zero,
                                                                        grad_reduce):
    run = runs()[(schedule, zero, grad_reduce)]
    s = run.schedule
    assert s.sharding == Sharding(zero, grad_reduce)      # the program that ran is recorded
    # the one a prediction before the run simulates (compare --calibrate-from)
    assert program_of(layout_config(schedule, 1, 2, zero=zero, grad_reduce=grad_reduce,
                                    steps=2)) == s
    program = [str(a) for a in s.actions(0)]
    t = run.trace
    assert run.steps == [0, 1]
    for step in run.steps:
        rows = t[(t["step"] == step) & (t["rank"] == 0)].sort_values(["start", "end"],
                                                                     kind="stable")
        shard = rows[rows["op"].isin(SHARD)]
        assert names(shard) == [a for a in program if any(op in a for op in SHARD)], step
        both = rows[rows["op"].isin(SHARD + COMPUTE)]
        assert names(both) == [str(a) for a in s.actions(0) if a.op in SHARD + COMPUTE], step
        assert set(shard["kind"]) == {"comm"} and (shard["end"] >= shard["start"]).all()
    ops = set(t["op"])
    assert ("UNSHARD" in ops) == ("RESHARD" in ops) == (zero == 3) and "REDUCE_GRAD" in ops


@pytest.mark.parametrize("schedule,zero,grad_reduce", CASES)
def test_calibration_prices_them_at_the_measured_per_stage_means(schedule, zero, grad_reduce):
    run = runs()[(schedule, zero, grad_reduce)]
    costs = fit_run(run)
    t = run.trace
    n = run.plan.num_stages
    for op, field in (("UNSHARD", "unshard"), ("REDUCE_GRAD", "reduce_grad")):
        rows = t[t["op"] == op]
        if zero == 2 and op == "UNSHARD":
            assert getattr(costs, field) == 0.0
            continue
        means = [float((rows["end"] - rows["start"])[rows["stage"] == st].mean())
                 for st in range(n)]
        assert costs.stage_values(field, n) == pytest.approx(means, rel=1e-12), op
        assert all(m > 0 for m in means)
    assert costs.overlap_sharding == 0.0


@pytest.mark.parametrize("schedule,zero,grad_reduce", CASES)
def test_compare_shows_them_predicted_vs_measured(schedule, zero, grad_reduce, tmp_path):
    run = runs()[(schedule, zero, grad_reduce)]
    c = compare_runs(run)
    s = run.schedule
    table = c.sharding_table()
    program = [a for a in s.actions(0) if a.op in SHARD]
    assert sorted(zip(table["action"], table["stage"])) == sorted({(a.op, a.stage)
                                                                   for a in program})
    for r in table.itertuples():
        count = sum(a.op == r.action and a.stage == r.stage for a in program)
        assert r.count_measured == r.count_predicted == count
        assert r.per_action_measured >= 0
        if r.action == "RESHARD":                         # free in the model
            assert r.per_action_predicted == 0.0
        else:                                             # priced from this very run
            assert r.per_action_predicted == pytest.approx(r.per_action_measured)
    # one rank, no messages: the rows tile the step, so its own costs give it back
    assert abs(c.report()["step_time_error"]) < 0.05
    text = c.text()
    assert "\n".join(sharding_text(table)) in text
    write_outputs(c, report_out=str(tmp_path / "r.json"), table_out=str(tmp_path / "t.md"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["sharding_actions"] == sharding_report(table)
    md = (tmp_path / "t.md").read_text()
    assert all(f"| {op} |" in md for op in set(table["action"]))


@pytest.mark.parametrize("schedule,zero,grad_reduce", CASES[:2])
def test_the_table_csv_holds_the_sharding_rows(schedule, zero, grad_reduce, tmp_path):
    run = runs()[(schedule, zero, grad_reduce)]
    c = compare_runs(run)
    path = tmp_path / "t.csv"
    assert write_outputs(c, table_out=str(path))["table"] == str(path)
    csv = pd.read_csv(path, dtype={"rank": str})
    assert csv.columns[0] == "row" and list(csv["row"]) == (
        ["rank"] * (run.plan.pp + 1) + ["sharding"] * len(c.sharding_table()))
    ranks = csv[csv["row"] == "rank"]
    assert list(ranks["rank"]) == [str(r) for r in range(run.plan.pp)] + ["all"]
    assert ranks["action"].isna().all() and ranks["count_measured"].isna().all()
    assert ranks["finish_predicted"].tolist() == pytest.approx(
        c.table()["finish_predicted"].tolist(), rel=1e-12)
    # the sharding rows: the figures sharding_rows computes from the two traces
    want = sharding_table(run.trace, c.steps, c.predicted.trace)
    got = csv[csv["row"] == "sharding"].reset_index(drop=True)
    assert list(got["action"]) == list(want["action"])
    assert [int(x) for x in got["stage"]] == list(want["stage"])
    assert list(got["rank"]) == [str(r) for r in want["rank"]]
    program = [a for a in run.schedule.actions(0) if a.op in SHARD]
    assert list(got["count_predicted"]) == [
        sum(a.op == op and a.stage == st for a in program)
        for op, st in zip(want["action"], want["stage"])]
    for q in QUANTITIES:
        for side in ("measured", "predicted"):
            col = f"{q}_{side}"
            assert got[col].tolist() == pytest.approx(want[col].tolist(), rel=1e-12,
                                                      nan_ok=True), col
    assert got["finish_measured"].isna().all()


def test_compare_table_out_csv_end_to_end(tmp_path, capsys):
    """The flag itself: ``pipeexec compare --zero 2 --table-out t.csv`` (2 ranks, 2 steps)."""
    from pipeexec.cli.compare import compare_main

    path, report = tmp_path / "t.csv", tmp_path / "r.json"
    assert compare_main(["--schedule", "1f1b", "--pp", "1", "--dp", "2", "--zero", "2",
                         "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
                         "--micro-batch-size", "2", "--microbatches", "2", "--steps", "2",
                         "--profile", "0:2", "--table-out", str(path),
                         "--report-out", str(report)]) == 0
    capsys.readouterr()
    csv = pd.read_csv(path, dtype={"rank": str})
    shard = csv[csv["row"] == "sharding"]
    # ZeRO-2 once a step at pp 1: one REDUCE_GRAD of the one stage a step
    assert list(zip(shard["action"], shard["stage"].astype(int), shard["rank"])) == [
        ("REDUCE_GRAD", 0, "0")]
    saved = json.loads(report.read_text())["sharding_actions"]
    assert len(saved) == 1
    for q in QUANTITIES:
        for side in ("measured", "predicted"):
            assert shard[f"{q}_{side}"].iloc[0] == pytest.approx(saved[0][f"{q}_{side}"],
                                                                 rel=1e-12)
