"""The comparison report: every column, values computed as defined, files written; and the
``pipeexec compare`` command end to end (a real profiled run, then a cross-schedule prediction
calibrated from its trace).

The synthetic "measured" run is a jittered simulation: its own calibration must then predict it
back within the jitter, which checks the whole chain trace -> costs -> simulation -> report.
"""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

import pipesim
from pipeexec.analysis import MeasuredRun
from pipeexec.analysis.calibrate import Layout
from pipeexec.analysis.compare import REPORT_KEYS, TABLE_COLUMNS, compare_runs
from pipeexec.cli.compare import write_outputs
from pipeexec.analysis.predict import EXECUTOR_COMM, predict


def jittered_run(name="zb-h1", pp=4, vpp=1, m=8, steps=2) -> MeasuredRun:
    s = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp)
    n = s.num_stages
    truth = pipesim.CostModel(forward=[1.0 + 0.1 * k for k in range(n)],
                              backward_input=[1.0] * n, backward_weight=[0.8] * n,
                              p2p_latency=0.01, p2p_bandwidth=1e4, p2p_bytes=[50.0] * n)
    act = [100.0 * (k + 1) for k in range(n)]
    frames = []
    for k in range(steps):
        t = pipesim.simulate(s, truth, jitter=0.04, seed=k).trace.copy()
        t["op"], t["kind"] = t["op"].astype(str), t["kind"].astype(str)
        t["step"] = k
        # memory readings: F adds act[stage] (held from its end), I keeps it, W / B release it;
        # a gradient's receive buffer (p2p_bytes) is held from its RECV to the end of its I / B
        t["mem_start"] = 0.0
        t["mem_end"] = 0.0
        held = {r: 0.0 for r in range(pp)}
        for i in t.sort_values(["rank", "start", "end"]).index:
            r, op, st = t.at[i, "rank"], t.at[i, "op"], t.at[i, "stage"]
            t.at[i, "mem_start"] = held[r]
            if op == "F":
                held[r] += act[st]
            elif op == "RECV_B":
                held[r] += 50.0
            if op in ("B", "W"):
                held[r] -= act[st]
            if op in ("B", "I") and st < n - 1:
                held[r] -= 50.0
            t.at[i, "mem_end"] = held[r]
        t["arrival_observed"] = True
        t["link_start"] = t["start"]
        t["start"] += 10.0 * k
        t["end"] += 10.0 * k
        t["link_start"] += 10.0 * k
        frames.append(t)
    meta = {"schedule": name, "pp": pp, "vpp": vpp, "microbatches": m,
            "bounds": list(range(n + 1)), "layer_kinds": ["block"] * n, "memory": "synthetic"}
    return MeasuredRun(pd.concat(frames, ignore_index=True), meta)


def test_report_has_every_column_with_values_as_defined(tmp_path):
    run = jittered_run()
    c = compare_runs(run)
    report = c.report()
    for key in REPORT_KEYS:
        assert key in report, key
    # measured: the means over the profiled steps (the costs are means over the same steps)
    assert c.steps == run.steps == [0, 1] and report["compared_steps"] == [0, 1]
    results = [run.result(s) for s in run.steps]
    mean = lambda xs: sum(xs) / len(xs)                   # noqa: E731
    assert report["measured_step_time"] == pytest.approx(mean([r.makespan for r in results]))
    assert report["measured_bubble_fraction"] == pytest.approx(
        mean([r.bubble_fraction for r in results]))
    assert report["measured_bubble_fraction_range"] == pytest.approx(
        sorted(r.bubble_fraction for r in results))
    assert report["step_time_error"] == pytest.approx(
        (report["predicted_step_time"] - report["measured_step_time"]) / report["measured_step_time"])
    assert len(report["measured_peak_memory"]) == len(report["predicted_peak_memory"]) == 4
    assert report["measured_peak_memory"] == pytest.approx(
        [max(r.peak_memory[k] for r in results) for k in range(4)])
    busy1 = [mean([r.busy[k] for r in results]) for k in range(4)]
    assert [row["busy_measured"] for row in report["per_rank"]] == pytest.approx(busy1)
    # one step alone, on request
    one = compare_runs(run, step=1).report()
    assert one["compared_steps"] == [1] and one["pictured_step"] == 1
    assert one["measured_step_time"] == pytest.approx(results[1].makespan)
    assert one["calibration"]["source"]["steps"] == [1]
    # the jittered run is predicted back from its own costs within the jitter
    assert abs(report["step_time_error"]) < 0.04
    assert abs(report["predicted_bubble_fraction"] - report["measured_bubble_fraction"]) < 0.03
    for meas, pred in zip(report["measured_peak_memory"], report["predicted_peak_memory"]):
        assert pred == pytest.approx(meas, rel=1e-9)       # same bytes, same order of events
    table = c.table()
    assert list(table.index) == ["0", "1", "2", "3", "all"]
    for q in TABLE_COLUMNS:
        for suffix in ("measured", "predicted", "error"):
            assert f"{q}_{suffix}" in table.columns
    assert table.loc["all", "finish_measured"] == pytest.approx(report["measured_step_time"])
    text = c.text()
    assert "zb-h1 pp=4" in text and text.count("\n") >= 7
    files = write_outputs(c, report_out=str(tmp_path / "r.json"), table_out=str(tmp_path / "t.csv"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(REPORT_KEYS) <= set(saved) and saved["files"]["plot"] == str(tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 10_000 and files["table"] == str(tmp_path / "t.csv")
    assert len(pd.read_csv(tmp_path / "t.csv")) == 5
    write_outputs(c, table_out=str(tmp_path / "t.md"))
    md = (tmp_path / "t.md").read_text().splitlines()
    assert md[0] == c.headline() and len(md) == 2 + 2 + 5
    assert all(line.count("|") == md[2].count("|") for line in md[2:])


def test_cross_schedule_prediction_uses_the_other_runs_costs():
    source = jittered_run("1f1b", steps=1)
    target = pipesim.build_schedule("gpipe", pp=4, microbatches=8)
    predicted, cal = predict(target, Layout.of_run(source), source)
    assert cal.source["schedule"] == "1f1b" and not cal.repartitioned
    # 1f1b runs B: gpipe predicted with the fitted per-stage F and B (B = I + W of the truth)
    fb = cal.costs.compute_times(4)
    assert fb["B"] == pytest.approx([1.8] * 4, rel=0.05)
    assert predicted.makespan == pytest.approx(
        pipesim.simulate(target, cal.costs, comm=EXECUTOR_COMM).makespan)
    assert math.isfinite(predicted.bubble_fraction)


# -- the command -----------------------------------------------------------------------------------
TINY = ["--pp", "2", "--microbatches", "4", "--micro-batch-size", "2", "--layers", "2",
        "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32", "--steps", "3",
        "--no-progress"]


def run_cli(argv):
    from pipeexec.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


@pytest.mark.slow
def test_compare_command_end_to_end(tmp_path, capsys):
    trace = tmp_path / "one" / "run.json"
    report = tmp_path / "rep.json"
    code = run_cli(["compare", "--schedule", "1f1b", *TINY, "--trace-out", str(trace),
                    "--report-out", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1f1b pp=2" in out and "calibrated from its own trace" in out
    data = json.loads(report.read_text())
    assert set(REPORT_KEYS) <= set(data) and data["compared_steps"] == [1, 2] and data["pictured_step"] in (1, 2)
    assert len(data["measured_peak_memory"]) == 2 and min(data["measured_peak_memory"]) > 0
    # and predicted from the plan alone (no calibration), within 10%
    assert "predicted from the plan alone" in out
    assert max(abs(e) for e in data["plan_peak_memory_error"]) < 0.10
    for suffix in (".json", ".csv", ".meta.json"):
        assert trace.with_name("run" + suffix).exists()
    chrome = json.loads(trace.read_text())
    assert any(e.get("args", {}).get("step") == 2 for e in chrome["traceEvents"])
    # predict another schedule from that trace, then run it
    report2 = tmp_path / "rep2.json"
    code = run_cli(["compare", "--schedule", "interleaved", "--vpp", "2", *TINY,
                    "--calibrate-from", str(trace), "--report-out", str(report2)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "prediction before running" in out
    data2 = json.loads(report2.read_text())
    cal = data2["calibration"]
    assert cal["source"]["schedule"] == "1f1b" and cal["repartitioned"]
    assert data2["vpp"] == 2 and len(data2["calibration"]["costs"]["F"]) == 4


def test_cli_argument_errors(tmp_path, capsys):
    assert run_cli(["train", *TINY, "--trace-out", str(tmp_path / "x.json")]) == 2
    assert "--trace-out needs --profile" in capsys.readouterr().err
    assert run_cli(["train", *TINY, "--profile", "2:9"]) == 2
    assert "reaches past" in capsys.readouterr().err
    assert run_cli(["compare", "--schedule", "1f1b", *TINY,
                    "--calibrate-from", str(tmp_path / "missing.json")]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.slow
def test_train_profile_writes_a_loadable_trace(tmp_path):
    from pipeexec.cli.main import main

    out = tmp_path / "t" / "run.json"
    main(["train", "--schedule", "zb-h1", *TINY, "--profile", "1:3", "--trace-out", str(out)])
    run = MeasuredRun.load(out)
    assert run.steps == [1, 2] and run.meta["schedule"] == "zb-h1"
    s = run.schedule
    rows = run.trace[run.trace["step"] == 2]
    assert len(rows) == sum(len(s.actions(r)) for r in range(s.pp))
    chrome = json.loads(out.read_text())
    assert sum(e["ph"] == "X" for e in chrome["traceEvents"]) == len(run.trace)
    result = run.result()
    assert result.makespan > 0 and len(result.peak_memory) == 2


@pytest.mark.slow
def test_without_profile_nothing_is_timed_or_synchronised(monkeypatch):
    """Clock alignment is the only start-up exchange profiling adds, and the recorder the
    only per-action hook: a run without --profile must use neither."""
    import types

    import pipeexec.measuring.session as session_mod
    from pipeexec import launch
    from pipeexec.cli.train import config_from_args
    from pipeexec.cli.main import _parser
    from pipeexec.run.worker import WorkerArgs, run_training

    def forbidden(*args, **kwargs):
        raise AssertionError("clock alignment ran")
    monkeypatch.setattr(session_mod, "align_clocks", forbidden)
    # the check bites: a profiled session would align clocks
    topo = types.SimpleNamespace(rank=0, world_size=2, device=torch_cpu())
    with pytest.raises(AssertionError, match="clock alignment ran"):
        session_mod.ProfileSession(session_mod.ProfileOptions(0, 1), topo)
    cfg = config_from_args(_parser().parse_args(["train", "--schedule", "1f1b", *TINY]))
    results = launch(run_training, 2, (WorkerArgs(cfg, progress=False),),
                     timeout=120)                                      # forked: patched too
    assert all(r.measured is None and "profile" not in r.metrics for r in results)
    assert len(results[0].metrics["losses"]) == cfg.optimizer.steps


def torch_cpu():
    import torch

    return torch.device("cpu")


# two hosts of 4 CPUs, 2 single-threaded ranks on each
TWO_HOSTS = {h: {"cpus": 4, "ranks": 2, "rank_cpus": 2.0, "max_rank_cpus": 1.0} for h in "ab"}


@pytest.mark.parametrize("rank_cpus,host,model", [(None, None, "processor-sharing"),
                                                  ([1.0] * 4, 2, "processor-sharing"),
                                                  ([1.0] * 4, 4, "processor-sharing"),
                                                  ([0.5] * 4, 2, "wall"),
                                                  ([1.0] * 4, 16, "wall"),
                                                  # per host: 2 of the 4 ranks on each of 2 hosts
                                                  ([1.0] * 4, {"hosts": TWO_HOSTS}, "wall")])
def test_cross_schedule_model_follows_whether_the_ranks_shared_cores(rank_cpus, host, model):
    """CPU work shared among cores only when the calibration run's ranks competed for them
    (together they could fill every CPU of the machine); ranks confined to a share each
    (--cpus-per-rank), or fewer ranks than cores, keep their wall-time costs."""
    source = jittered_run("1f1b", steps=1)
    t = source.trace
    compute = t["kind"] == "compute"
    t.loc[compute, "cpu"] = (t.loc[compute, "end"] - t.loc[compute, "start"]) * 0.5
    if rank_cpus is not None:
        hosts = host if isinstance(host, dict) else {}
        source.meta.update(rank_cpus=rank_cpus, host_cpus=4 if hosts else host, **hosts)
    target = pipesim.build_schedule("gpipe", pp=4, microbatches=8)
    predicted, cal = predict(target, Layout.of_run(source), source)
    assert cal.model == model
    if model == "wall":
        assert cal.cores is None
        assert predicted.makespan == pytest.approx(
            pipesim.simulate(target, cal.costs, comm=EXECUTOR_COMM).makespan)
        assert cal.costs.compute_times(4)["F"] == pytest.approx([1.0, 1.1, 1.2, 1.3], rel=0.05)
    else:
        # CPU work (half the wall time here) as the costs
        assert cal.costs.compute_times(4)["F"] == pytest.approx([0.5, 0.55, 0.6, 0.65], rel=0.05)


@pytest.mark.parametrize("meta,note", [
    ({"rank_cpus": [1.0] * 4, "host_cpus": 2, "device": "cpu"}, "--cpus-per-rank 0.5"),
    ({"rank_cpus": [1.0] * 2, "host_cpus": 2, "device": "cpu", "dp": 2}, "--cpus-per-rank 0.5"),
    ({"rank_cpus": [2.0] * 4, "host_cpus": 4, "device": "cpu"}, "--cpus-per-rank 1"),
    ({"rank_cpus": [1.0] * 2, "host_cpus": 2, "device": "cpu"}, None),     # a core each
    ({"rank_cpus": [0.5] * 4, "host_cpus": 2, "device": "cpu"}, None),     # confined
    ({"rank_cpus": [1.0] * 4, "host_cpus": 2, "device": "cuda:0"}, None),
    ({"rank_cpus": [1.0] * 4, "host_cpus": 4, "device": "cpu", "hosts": TWO_HOSTS}, None),
    ({"rank_cpus": [1.0] * 4, "host_cpus": 4, "device": "cpu",
      "hosts": {**TWO_HOSTS, "b": {"cpus": 1, "ranks": 2, "rank_cpus": 2.0, "max_rank_cpus": 1.0}}},
     "of one host: an action"),
    ({}, None)])                                                           # not recorded
def test_a_run_whose_ranks_time_shared_cores_says_so(meta, note):
    run = jittered_run("1f1b", steps=1)
    run.meta.update(meta)
    c = compare_runs(run)
    said = c.report()["note"]
    if note is None:
        assert said is None and "note:" not in c.text()
    else:
        assert note in said and f"note: {said}" in c.text()
        ranks = 2 if "hosts" in meta else len(meta["rank_cpus"]) * meta.get("dp", 1)
        assert said.startswith(f"{ranks} ranks wanting")


def test_a_stalled_step_moves_neither_the_measured_mean_nor_the_costs():
    run = jittered_run(steps=5)
    t = run.trace
    stalled = t["step"] == 2
    t0 = t.loc[stalled, "start"].min()
    for col in ("start", "end", "link_start"):                  # step 2 runs 1.5x slower
        t.loc[stalled, col] = t0 + (t.loc[stalled, col] - t0) * 1.5
    spans = run.makespans()
    shortest = min(spans, key=spans.get)
    central = run.central_steps()
    assert 2 not in central and shortest not in central and len(central) == 3
    c = compare_runs(run)
    report = c.report()
    assert report["compared_steps"] == central
    assert report["measured_step_time"] == pytest.approx(sum(spans[s] for s in central) / 3)
    assert report["calibration"]["source"]["steps"] == central
    assert abs(report["step_time_error"]) < 0.04             # the stall is not in the costs
    # with the stalled step in, both the mean and the costs would move
    assert compare_runs(run, step=2).report()["measured_step_time"] == pytest.approx(spans[2])
    assert spans[2] > 1.4 * report["measured_step_time"]


def test_an_idle_over_busy_error_without_meaning_is_not_printed():
    """A rank idle most of the step has an unbounded idle/busy ratio: its difference in points
    is shown as n/a, with a line saying why, never as hundreds of points."""
    from pipeexec.analysis.compare import _points

    assert _points(0.12, 0.10) == "-2.0pt"
    assert _points(9.9, 1.05) == "n/a" and _points(0.2, math.inf) == "n/a"
    run = jittered_run()
    c = compare_runs(run)
    c._measured["idle_over_busy"][0] = 9.85            # as ZB-V's embedding-and-head rank reads
    text = c.text()
    row0 = next(line for line in text.splitlines() if line.startswith("   0 |"))
    assert "n/a" in row0 and "pt" not in row0.split("|")[4]
    assert "n/a: an idle/busy ratio above 1" in text


def test_the_headline_says_what_measured_means_and_the_figure_title_its_panels_statistic():
    c = compare_runs(jittered_run(steps=4))
    assert "the pipeline's makespan, first action to last: the log's step_time adds the " \
           "optimizer step" in c.headline()
    fig = c.figure()
    titles = [t.get_text() for t in fig.texts] + [ax.get_title(loc=loc) for ax in fig.axes
                                                  for loc in ("left", "center")]
    title = next(t for t in titles if "vs measured step" in t).replace("\n", " ")
    want = c.predicted.makespan / c.measured.makespan - 1
    assert f"vs measured step {c.step} (the median of the compared steps)" in title
    assert f"({want:+.1%})" in title and "over the compared steps' mean" in title


def test_a_cross_schedule_prediction_says_which_rank_rows_are_least_reliable():
    source = jittered_run("1f1b", steps=1)
    target = jittered_run("zb-h1", steps=2)
    cross = compare_runs(target, source)
    assert cross.cross_schedule_edge_ranks() == [0, 3]
    assert "note: predicted from another schedule's run: the rows of rank(s) 0, 3 (embedding, " \
           "head) are the least reliable" in cross.text()
    own = compare_runs(target)
    assert own.cross_schedule_edge_ranks() == [] and "another schedule's run" not in own.text()
    # a calibration that pinned both at what the run timed them alone says so instead
    cross.calibration.pinned = {"forward": {"embedding": 0.1, "head": 0.2}}
    text = cross.text()
    assert "least reliable" not in text
    assert "rank(s) 0, 3 hold the embedding and the head, whose costs are their shares" in text
    assert cross.report()["calibration"]["pinned_layers"] == cross.calibration.pinned


def test_one_bubble_fraction_named_where_it_is_printed():
    """The run's bubble_fraction is one figure, the mean of the compared steps' own (the
    report's); the table's idle/busy and the picture's single step are labelled as what they
    are, not as the run's bubble_fraction (three figures once read as one)."""
    run = jittered_run()
    c = compare_runs(run)
    report, text = c.report(), c.text()
    assert (f"predicted {report['predicted_bubble_fraction']:.3f} vs measured "
            f"{report['measured_bubble_fraction']:.3f}") in c.headline()
    head = text.splitlines()[2]
    assert "idle/busy" in head and "bubble_fraction" not in head
    assert "the mean of each step's own" in c.legend()
    fig = c.figure()
    titles = " ".join(ax.get_title(loc) for ax in fig.axes for loc in ("left", "center", "right"))
    assert "this step's own bubble_fraction" in titles
