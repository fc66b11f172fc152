"""`pipesim plan`: the ranked table, the files it writes, and its failure cases."""
from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from pipesim.cli import main
from pipesim.plan.plan import Plan
from pipesim.sim.plan_report import simulate_plan

BASE = ["plan", "--model", "tiny", "--gpus", "4", "--gbs", "16", "--hardware", "A100",
        "--mbs", "1,2", "--recompute", "none,full", "--cp", "1", "--no-progress", "--workers", "1"]


def run_plan(tmp_path, *extra: str) -> int:
    return main(BASE + ["--out", str(tmp_path / "plans.csv"), "--plan-out",
                        str(tmp_path / "plan.json"), "--frontier", str(tmp_path / "frontier.png"),
                        "--gantt", str(tmp_path / "gantt.png"), *extra])


def test_plan_writes_table_files_and_a_plan_that_resimulates_identically(tmp_path, capsys):
    assert run_plan(tmp_path, "--top", "5", "--memory-limit", "0.5GiB") == 0
    out = capsys.readouterr().out
    assert "tokens/s/GPU" in out and "why " in out and "memory limit 0.5 GiB" in out
    table = [line for line in out.splitlines() if line[:3].strip().isdigit() and "  " in line[:4]]
    assert len(table) == 5
    rows = pd.read_csv(tmp_path / "plans.csv")
    assert {"key", "status", "step_time", "peak_memory", "memory_bound", "step_time_bound",
            "tokens_per_s_per_gpu", "mfu"} <= set(rows.columns)
    ok = rows[(rows["status"] == "simulated") & (rows["fits"] == True)]  # noqa: E712
    best = ok.sort_values(["step_time", "key"]).iloc[0]
    assert best["key"] in table[0]
    for png in ("frontier.png", "gantt.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    # the plan file: `pipesim simulate --plan` reads it and finds the same step
    plan = Plan.from_json(tmp_path / "plan.json")
    assert simulate_plan(plan).step_time == pytest.approx(best["step_time"], rel=1e-12)
    report = tmp_path / "report.json"
    assert main(["simulate", "--plan", str(tmp_path / "plan.json"), "--report-out",
                 str(report)]) == 0
    assert json.loads(report.read_text())["step_time"] == pytest.approx(best["step_time"],
                                                                       rel=1e-12)
    assert max(json.loads(report.read_text())["peak_memory"]) <= 0.5 * 2 ** 30


def test_zb_auto_refines_the_best_layouts_and_writes_the_winner_with_its_schedule(tmp_path,
                                                                                    capsys):
    # at 0.35 GiB the best handcrafted plan is 1F1B's, and zb-auto finds a faster order of its
    # own on that layout that fits
    assert run_plan(tmp_path, "--top", "3", "--memory-limit", "0.35GiB", "--zb-auto", "2") == 0
    out = capsys.readouterr().out
    assert "zb-auto on the best 2 layouts" in out
    rows = [line for line in out.split("zb-auto on the best 2 layouts")[1].splitlines()[2:4]]
    assert len(rows) == 2 and all(" z" in r for r in rows)
    ranked_best = pd.read_csv(tmp_path / "plans.csv").query("status == 'simulated' and fits")[
        "step_time"].min()
    assert "best: zb-auto's order on" in out, out
    plan = Plan.from_json(tmp_path / "plan.json")                 # the winner, its schedule as data
    assert plan.schedule_name == "zb-auto" and not isinstance(plan.schedule, str)
    assert json.loads((tmp_path / "plan.json").read_text())["schedule"]["name"] == "zb-auto"
    got = simulate_plan(plan)
    assert got.step_time < ranked_best and max(got.peak_memory) <= 0.35 * 2 ** 30
    assert run_plan(tmp_path, "--zb-auto", "-1") == 2
    assert "--zb-auto must be >= 0" in capsys.readouterr().err


def test_plan_jitter_reports_whether_the_order_holds(tmp_path, capsys):
    assert run_plan(tmp_path, "--top", "3", "--jitter", "0.02", "--jitter-seeds", "2") == 0
    assert "jitter +-2% on the top 3 plans, 2 seeds: order" in capsys.readouterr().out


def test_nothing_fits_says_why_and_exits_non_zero(tmp_path, capsys):
    assert run_plan(tmp_path, "--memory-limit", "100MiB") == 1
    err = capsys.readouterr().err
    assert "nothing fits" in err
    assert "over the 0.1 GiB limit; largest:" in err
    assert not (tmp_path / "plan.json").exists()
    # a failed search writes nothing (issue: it used to rewrite plans.csv beside an older
    # plan.json); the closest plans are printed instead
    assert not (tmp_path / "plans.csv").exists()


def test_a_failed_search_leaves_the_files_of_the_earlier_run_as_they_were(tmp_path, capsys):
    assert run_plan(tmp_path, "--memory-limit", "0.5GiB") == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {"plans.csv", "plan.json", "frontier.png", "gantt.png"}
    capsys.readouterr()
    assert run_plan(tmp_path, "--memory-limit", "100MiB") == 1
    assert "no files written (--out " in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_plan_writes_only_the_files_asked_for_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(BASE + ["--memory-limit", "0.5GiB"]) == 0
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert "no files written: --out FILE" in out
    assert main(BASE + ["--memory-limit", "0.5GiB", "--plan-out", "best.json"]) == 0
    out = capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]
    assert "wrote best.json  (the best plan" in out


def test_one_count_of_simulated_plans_in_the_summary_the_csv_and_the_frontier(tmp_path, capsys):
    """The summary is printed once everything that simulates has run (the why table simulates
    pruned neighbours): its counts are the CSV's status counts, and the frontier's title's."""
    import re

    assert run_plan(tmp_path, "--memory-limit", "0.5GiB") == 0
    out = capsys.readouterr().out
    rows = pd.read_csv(tmp_path / "plans.csv")
    counts = rows["status"].value_counts()
    summary = next(line for line in out.splitlines() if "plans enumerated" in line)
    assert f"{len(rows):,} plans enumerated" in summary
    assert f"{counts['simulated']:,} simulated" in summary
    for status, n in counts.items():
        if status != "simulated":
            assert f"{n:,} {status}" in summary, (status, summary)
    assert "(simulated to explain)" in " ".join(rows["reason"].fillna("")), \
        "the why table simulated no pruned neighbour: the test shows nothing"
    assert "refused " in out and re.search(r"refused +[\d,]+  \S", out)
    assert f"wrote {tmp_path / 'frontier.png'}  (peak memory vs tokens/s of the " \
        f"{counts['simulated']:,} simulated plans)" in out


def test_the_why_table_names_every_knob_each_row_changes(tmp_path, capsys):
    from pipesim.planner.explain import CHANGED, explain
    from pipesim.planner.search import search
    from pipesim.planner.enumerate import SearchSpace
    from pipesim.plan.model import get_model
    from pipesim.hardware import get_hardware

    space = SearchSpace(get_model("tiny"), gpus=8, gbs=16, hardware=get_hardware("A100"),
                        mbs=(1, 2), recompute=("none", "full"), cp=(1,))
    result = search(space, memory_limit=0.5 * 2 ** 30, workers=1)
    table = explain(result)
    win = result.ranked.iloc[0]
    rows = result.rows.set_index("key")
    assert len(table) >= 3
    several = 0
    for _, r in table.iterrows():
        other = rows.loc[r["key"]]
        changed = [k for k in CHANGED if other[k] != win[k]]
        assert r["change"] == ", ".join(f"{k} {win[k]} -> {other[k]}" for k in changed)
        several += len(changed) > 1
    assert several, "no row changed more than one knob: the test shows nothing"


def test_no_valid_plan_lists_the_refusals(tmp_path, capsys):
    # 12 GPUs are not a whole number of 8-GPU nodes
    assert main([a if a != "4" else "12" for a in BASE] + ["--out", str(tmp_path / "p.csv")]) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert "no valid plan" in err and "not a whole number of 8-GPU nodes" in err
    summary = next(line for line in captured.out.splitlines() if "plans enumerated" in line)
    assert summary.startswith("0 plans enumerated (1 combination refused), 0 simulated; search ")
    assert ", ;" not in captured.out and "no files written" in captured.out


def test_bad_memory_limit_and_out_suffix_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:        # argparse's usage error, before any search
        run_plan(tmp_path, "--memory-limit", "80 parsecs")
    assert info.value.code == 2
    assert "memory size '80 parsecs'" in capsys.readouterr().err
    assert main(BASE + ["--out", str(tmp_path / "plans.txt")]) == 2
    assert ".csv or .parquet" in capsys.readouterr().err


def test_parquet_out(tmp_path):
    pytest.importorskip("pyarrow")
    assert main(BASE + ["--out", str(tmp_path / "plans.parquet"), "--plan-out",
                        str(tmp_path / "plan.json"), "--frontier", "", "--gantt", ""]) == 0
    rows = pd.read_parquet(tmp_path / "plans.parquet")
    assert len(rows) > 10 and "step_time" in rows.columns


_DASK_RUN = """
import json, sys
import distributed
from pipesim.cli import main
from pipesim.planner import SearchSpace, search

space = SearchSpace("tiny", gpus=4, gbs=16, hardware="A100", mbs=(1, 2),
                    recompute=("none", "full"), cp=(1,))
out = sys.argv[1]
with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                              dashboard_address=None) as cluster:
    with distributed.Client(cluster.scheduler_address) as client:
        workers = len(client.scheduler_info()["workers"])
        remote = search(space, executor=client.get_executor(), workers=2)
    code = main(["plan", "--model", "tiny", "--gpus", "4", "--gbs", "16", "--hardware", "A100",
                 "--mbs", "1,2", "--recompute", "none,full", "--cp", "1", "--no-progress",
                 "--dask", cluster.scheduler_address, "--out", out + "/p.csv",
                 "--plan-out", out + "/plan.json", "--frontier", "", "--gantt", ""])
top = remote.ranked.head(5)
print(json.dumps({"workers": workers, "code": code, "keys": list(top["key"]),
                  "steps": [float(x) for x in top["step_time"]]}))
"""


@pytest.mark.slow
def test_dask_local_cluster_of_two_workers_gives_the_same_plan(tmp_path):
    """In a subprocess: Dask leaves threads behind, and pipeexec's launcher refuses to fork a
    process that has threads."""
    pytest.importorskip("distributed")
    from pipesim.planner import SearchSpace, search

    space = SearchSpace("tiny", gpus=4, gbs=16, hardware="A100", mbs=(1, 2),
                        recompute=("none", "full"), cp=(1,))
    local = search(space, workers=1)
    done = subprocess.run([sys.executable, "-c", _DASK_RUN, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["workers"] == 2 and got["code"] == 0
    assert got["keys"] == list(local.ranked["key"][:5])
    assert got["steps"] == list(local.ranked["step_time"][:5])
    assert Plan.from_json(tmp_path / "plan.json") == local.best


def test_plan_help_lists_the_flags():
    out = subprocess.run([sys.executable, "-m", "pipesim", "plan", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--model", "--gpus", "--hardware", "--gbs", "--seq", "--memory-limit",
                 "--schedules", "--top", "--out", "--plan-out", "--no-progress", "--workers",
                 "--dask", "--jitter", "--rate", "--compare", "--robust"):
        assert flag in out


def test_the_plan_gantt_names_model_and_cluster_and_draws_the_step_tail(tmp_path):
    from pipesim.cli.plan_output import plan_gantt

    plan = Plan.create("tiny", "A100", schedule="1f1b", pp=2, dp=4, global_batch_size=16)
    r = simulate_plan(plan)
    assert r.step_time > r.pipeline_time             # a tail to draw
    fig = plan_gantt(r, "1f1b tp1 pp2 dp4")
    ax = fig.axes[0]
    assert ax.get_title(loc="left").startswith("tiny on 8 x A100: 1f1b tp1 pp2 dp4")
    assert ax.get_xlim()[1] == pytest.approx(r.step_time)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "dp reduction (exposed)" in labels and "optimizer step" in labels


def test_gantt_titles_say_vpp_as_simulate_does():
    """dualpipe holds one model part and a copy a rank: vpp=1, as `pipesim simulate` says."""
    import pipesim

    r = pipesim.simulate(pipesim.build_schedule("dualpipe", pp=4, microbatches=8),
                         pipesim.CostModel.uniform())
    title = r.gantt().axes[0].get_title(loc="left")
    assert "pp=4 vpp=1 (and a copy a rank) m=8" in title


def test_counts_in_the_summary_take_the_noun_in_the_right_number():
    from pipesim.cli.plan_output import counted

    assert [counted(n, "plan") for n in (0, 1, 2, 1234)] == ["0 plans", "1 plan", "2 plans",
                                                            "1,234 plans"]


# -- --rate / --compare and --robust, from the command line --------------------------------------
LIMIT = ["--memory-limit", "0.5GiB"]
RATED_KNOBS = ("schedule", "tp", "cp", "pp", "micro_batch_size", "recompute", "zero",
               "sequence_parallel", "ep")


def one_knob(mine: Plan, best: Plan, knob: str) -> Plan:
    """``mine`` with ``knob`` at the best plan's value: tp, cp and pp keep the 4 GPUs by dp."""
    if knob == "schedule":
        return mine.with_(schedule=best.schedule_name, vpp=best.parallelism.vpp)
    value = getattr(best.parallelism, knob)
    if knob in ("tp", "cp", "pp"):
        sizes = {k: getattr(mine.parallelism, k) for k in ("tp", "cp", "pp")} | {knob: value}
        return mine.with_(**{knob: value, "dp": 4 // (sizes["tp"] * sizes["cp"] * sizes["pp"])})
    return mine.with_(**{knob: value})


def knob_value(plan: Plan, knob: str):
    if knob == "schedule":                        # the schedule and its vpp move together
        return plan.schedule_name, plan.parallelism.vpp
    return getattr(plan.parallelism, knob)


def rating_block(out: str) -> list[str]:
    start = out.index("your plan: ")
    return out[start:].split("\n\n")[0].splitlines()


def test_rate_prints_your_plan_against_the_best_and_each_knob_changed_alone(tmp_path, capsys):
    import re

    mine = Plan.create("tiny", "A100", schedule="1f1b", tp=1, pp=4, dp=1, global_batch_size=16,
                       micro_batch_size=1, recompute="full")
    mine.to_json(tmp_path / "mine.json")
    best_file = tmp_path / "best.json"
    assert main(BASE + LIMIT + ["--plan-out", str(best_file), "--rate",
                                str(tmp_path / "mine.json")]) == 0
    out = capsys.readouterr().out
    best = Plan.from_json(best_file)
    mine_r, best_t = simulate_plan(mine), simulate_plan(best).step_time
    head, title, *changes = rating_block(out)
    # the two changes that save the most, together, last
    assert changes[-1].startswith("the two largest together: "), changes[-1]
    together, changes = changes[-1], changes[:-1]
    assert head.startswith(f"your plan: {mine_r.step_time:.4g} s a step, "
                           f"{best_t / mine_r.step_time:.2f}x the best plan's throughput "
                           f"({best_t:.4g} s); ")
    peak = max(mine_r.peak_memory)           # against the search's limit, not the GPU's
    assert ("; fits: " if peak <= 2 ** 29 else "; does not fit: ") in head
    assert f"peak {peak / 2 ** 30:.2f} GiB on rank" in head and "search's 0.50 GiB limit" in head
    assert title.startswith("one knob at a time")
    differ = [k for k in RATED_KNOBS if knob_value(mine, k) != knob_value(best, k)]
    assert len(differ) >= 3, "mine is too close to the best: the test shows little"
    printed, invalid = {}, []
    for line in changes:
        m = re.match(r"  (\w+) .+ -> .+: ([\d.e+-]+) s, ([\d.]+)% (faster|slower)", line)
        if m is None:                                  # listed last, with the reason
            assert "not valid alone" in line, line
            invalid.append(re.match(r"  (\w+) ", line)[1])
            continue
        assert not invalid, "a valid change listed after an invalid one"
        printed[m[1]] = (float(m[2]), float(m[3]) * (1 if m[4] == "faster" else -1))
    assert sorted([*printed, *invalid]) == sorted(differ)
    for knob, (t, gain) in printed.items():
        want = simulate_plan(one_knob(mine, best, knob)).step_time
        assert t == pytest.approx(want, rel=1e-3), knob
        assert gain == pytest.approx(100 * (1 - want / mine_r.step_time), abs=0.06), knob
    for knob in invalid:
        with pytest.raises(ValueError):                # PlanError is one
            simulate_plan(one_knob(mine, best, knob))
    times = [t for t, _ in printed.values()]
    assert times == sorted(times)                     # the largest saving first
    k1, k2 = list(printed)[:2]
    m = re.match(rf"the two largest together: {k1} .+ -> .+ and {k2} .+ -> .+: ([\d.e+-]+) s, ",
                 together)
    assert m, together
    want = simulate_plan(one_knob(one_knob(mine, best, k1), best, k2)).step_time
    assert float(m[1]) == pytest.approx(want, rel=1e-3)
    # --compare is the same flag
    assert main(BASE + LIMIT + ["--compare", str(tmp_path / "mine.json")]) == 0
    assert rating_block(capsys.readouterr().out) == [head, title, *changes, together]


def test_rate_refuses_a_plan_of_another_cluster_size_before_searching(tmp_path, capsys):
    Plan.create("tiny", "A100", tp=1, pp=2, dp=4, global_batch_size=16).to_json(
        tmp_path / "eight.json")
    assert main(BASE + ["--rate", str(tmp_path / "eight.json")]) == 2
    captured = capsys.readouterr()
    assert "--rate " in captured.err and "uses 8 GPUs, the search 4: give --gpus 8" in captured.err
    assert "plans enumerated" not in captured.out
    assert main(BASE + ["--compare", str(tmp_path / "missing.json")]) == 2
    assert "--rate " in capsys.readouterr().err


def test_robust_re_ranks_the_tables_top_k_and_zero_turns_it_off(capsys):
    from pipesim.planner.enumerate import SearchSpace
    from pipesim.planner.robustness import robustness_check
    from pipesim.planner.search import search

    result = search(SearchSpace("tiny", 4, 16, hardware="A100", mbs=(1, 2),
                                recompute=("none", "full"), cp=(1,)),
                    memory_limit=2 ** 29, workers=1)
    assert main(BASE + LIMIT + ["--robust", "2"]) == 0            # the default is 3
    out = capsys.readouterr().out
    top = result.ranked.head(2)
    want = robustness_check([result.plans[key] for key in top["key"]], list(top["key"]))
    assert want.text() in out
    assert "robustness: the top 2 plans under efficiency +-10% and links +-20% (4 scenarios): " \
        in out
    assert main(BASE + LIMIT + ["--robust", "0"]) == 0
    assert "robustness:" not in capsys.readouterr().out
