"""`pipesim simulate` and `pipesim sweep` through pipesim.cli.main."""
import json
import re

import pandas as pd
import pytest

from pipesim import CostModel
from pipesim.cli import main


def test_simulate_writes_everything(tmp_path, capsys):
    out = {k: tmp_path / f"o.{k}" for k in ("png", "json", "csv")}
    costs = tmp_path / "costs.json"
    rc = main(["simulate", "1f1b", "--pp", "2", "-m", "4", "--gantt", str(out["png"]),
               "--chrome", str(out["json"]), "--trace-csv", str(out["csv"]),
               "--save-costs", str(costs)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bubble_fraction (Megatron, idle/ideal) 0.2500" in text    # (p-1)/m
    assert out["png"].read_bytes()[:4] == b"\x89PNG"
    assert "traceEvents" in json.loads(out["json"].read_text())
    assert len(pd.read_csv(out["csv"])) > 0
    assert CostModel.load(costs) == CostModel.uniform(1.0, 2.0)
    # The saved costs feed back in.
    assert main(["simulate", "gpipe", "--pp", "2", "-m", "4", "--costs", str(costs)]) == 0


def test_simulate_forward_only(capsys):
    assert main(["simulate", "gpipe", "--pp", "3", "-m", "5", "--forward-only"]) == 0
    # Forwards only, F = 1: makespan m + p - 1, bubble_fraction (p-1)/m.
    out = capsys.readouterr().out
    assert "makespan 7 units" in out and "0.4000" in out


def test_simulate_transformer_and_step_tail(capsys):
    rc = main(["simulate", "zbv", "--pp", "2", "--vpp", "2", "-m", "4", "--model", "tiny",
               "--hardware", "A100", "--step-tail", "--dp", "4", "--comm", "blocking"])
    assert rc == 0
    assert "peak_memory" in capsys.readouterr().out


def test_simulate_rendezvous_lookahead_and_shared_cores(tmp_path, capsys):
    costs = tmp_path / "c.json"
    CostModel(forward=1.0, backward=2.0, p2p_latency=0.5).save(costs)
    # the 1F1B of tests/test_sim_engine.py: rendezvous costs a transfer on the critical path
    # unless the receive is posted a computation early (10.5 s vs 10 s)
    base = ["simulate", "1f1b", "--pp", "2", "-m", "2", "--costs", str(costs), "--comm", "rendezvous"]
    assert main(base) == 0 and "makespan 10.5 s" in capsys.readouterr().out
    assert main(base + ["--recv-lookahead", "1"]) == 0 and "makespan 10 s" in capsys.readouterr().out
    # one shared core: the step is all the work, 2 ranks x 2 microbatches x 3 s
    assert main(["simulate", "1f1b", "--pp", "2", "-m", "2", "--cores", "1"]) == 0
    assert "makespan 12 units" in capsys.readouterr().out
    out = tmp_path / "sweep.csv"
    assert main(["sweep", "--schedules", "1f1b", "--pp", "2", "-m", "2", "--cores", "1",
                 "--out", str(out), "--no-progress"]) == 0
    assert pd.read_csv(out)["makespan"].tolist() == [12.0]


@pytest.mark.parametrize("argv,match", [
    (["simulate", "gpipe", "--vpp", "2"], "gpipe needs vpp == 1"),
    (["simulate", "1f1b", "--costs", "/nonexistent/c.json"], "No such file"),
    (["simulate", "1f1b", "--hardware", "A100"], "--hardware needs --model"),
    # a misspelled preset is named first, with the known ones
    (["simulate", "1f1b", "--hardware", "H800"], "unknown hardware preset 'H800'; known: A100"),
    (["sweep", "--schedules", "1f1b", "zzz", "--out", "x.csv"],
     "unknown schedule name(s) 'zzz'; known: gpipe, 1f1b"),
    (["simulate", "1f1b", "--model", "gpt-9"], "unknown model preset 'gpt-9'"),
])
def test_simulate_errors(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_sweep_limits_say_which_failed(tmp_path, capsys):
    out = tmp_path / "sweep.csv"
    rc = main(["sweep", "--schedules", "1f1b", "gpipe", "--pp", "2", "4", "-m", "4", "8",
               "--inflight-limit", "3", "--memory-limit", "7B", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    # the progress bar draws only on a terminal: captured, stderr is not one (its frames
    # would mix into the log lines)
    assert "pipesim sweep" not in captured.err
    table = pd.read_csv(out).fillna("")
    assert len(table) == 8
    status = {(r.schedule, r.pp, r.microbatches): (r.status, r.reason) for r in table.itertuples()}
    assert status[("1f1b", 2, 8)] == ("ok", "")
    assert status[("1f1b", 4, 4)] == ("infeasible", "in-flight limit: rank 0 holds 4 microbatches > 3")
    # GPipe holds all m microbatches: 8 bytes of activations break the 7-byte limit too.
    assert status[("gpipe", 2, 8)][1] == ("memory limit: rank 0 peaks at 8 bytes > 7 bytes; "
                                          "in-flight limit: rank 0 holds 8 microbatches > 3")
    ok = table[table["status"] == "ok"]
    assert (ok["bubble_fraction"] == (ok["pp"] - 1) / ok["microbatches"]).all()


def test_sweep_invalid_and_model(tmp_path, capsys):
    out = tmp_path / "s.csv"
    rc = main(["sweep", "--schedules", "interleaved", "1f1b", "--pp", "2", "--vpp", "1", "2",
               "-m", "4", "--micro-batch-size", "1", "2", "--model", "tiny", "--hardware", "H200",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    table = pd.read_csv(out)
    assert len(table) == 8
    bad = table[table["status"] == "invalid"]
    assert set(bad["schedule"]) == {"1f1b"} and (bad["vpp"] == 2).all()
    assert "invalid (2 configurations): 1f1b: 1f1b needs vpp == 1" in capsys.readouterr().err
    ok = table[table["status"] == "ok"]
    # Twice the sequences per microbatch: about twice the step time and the samples.
    one = ok[ok["micro_batch_size"] == 1].set_index(["schedule", "vpp"])["makespan"]
    two = ok[ok["micro_batch_size"] == 2].set_index(["schedule", "vpp"])["makespan"]
    assert ((two / one) > 1.9).all() and ((two / one) < 2.1).all()


def test_sweep_exits_non_zero_when_nothing_is_feasible(tmp_path, capsys):
    out = tmp_path / "s.csv"
    argv = ["sweep", "--schedules", "1f1b", "--pp", "2", "--model", "tiny", "--out", str(out),
            "--no-progress", "--memory-limit"]
    assert main([*argv, "80B"]) == 1                # 80 bytes: nothing fits
    assert "peaks at" in capsys.readouterr().err
    assert main([*argv, "80GiB"]) == 0
    assert main([*argv, "80GB"]) == 0
    assert "0 of" not in capsys.readouterr().out


def test_sweep_marks_a_refused_cost_model_invalid():
    """A cost factory that can't serve a layout (e.g. more stages than layers) is a row, not a crash."""
    import pipesim
    from pipesim.sim.sweep import sweep

    def factory(num_stages, micro_batch_size):
        if num_stages > 4:
            raise ValueError(f"cannot cut 4 layers into {num_stages} stages")
        return pipesim.CostModel.uniform(1.0, 2.0)

    frame = sweep(["1f1b"], pp=[2, 8], vpp=[1], microbatches=[8], costs=factory)
    assert list(frame.status) == ["ok", "invalid"]
    assert "cannot cut 4 layers into 8 stages" in frame.reason[1]
    assert str(frame.peak_inflight.dtype) == "Int64" and frame.peak_inflight[0] == 2


def test_sweep_leaves_no_thread_behind(tmp_path):
    """pipeexec forks workers from the same process; a leftover thread (tqdm's monitor) forbids it."""
    import threading

    from pipesim.cli import main

    before = {t.name for t in threading.enumerate()}
    assert main(["sweep", "--schedules", "1f1b", "--pp", "2", "--microbatches", "4",
                 "--out", str(tmp_path / "s.csv")]) == 0
    assert {t.name for t in threading.enumerate()} <= before


def test_sweep_with_a_model_holds_the_limit_plan_holds(tmp_path, capsys):
    """With --model and no --memory-limit, a configuration fits under the memory `pipesim plan`
    holds a plan to (the capacity less the reserve, over the fragmentation), stated in GiB."""
    import pipesim
    from pipesim.hardware import get_hardware

    gib = 2 ** 30
    hw = get_hardware("H100")
    usable = (hw.memory_bytes - hw.reserve) / hw.fragmentation
    plan = pipesim.Plan.create("tiny", "H100", global_batch_size=8)
    assert pipesim.simulate(plan).usable_memory == pytest.approx(usable, rel=1e-12)
    # ZB-H2 at pp 4, m 8 peaks between the usable memory and the capacity: the default decides
    schedule = pipesim.build_schedule("zb-h2", pp=4, microbatches=8)
    peak = max(pipesim.simulate(schedule, CostModel.transformer("gpt3-6.7b", "H100", num_stages=4))
               .peak_memory)
    assert usable < peak < hw.memory_bytes
    argv = ["sweep", "--schedules", "zb-h2", "--pp", "4", "-m", "8", "--model", "gpt3-6.7b",
            "--out", str(tmp_path / "s.csv"), "--no-progress"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert f"memory limit {usable / gib:.3g} GiB: H100's usable memory" in captured.out
    assert f"rank 0 peaks at {peak / gib:.3g} GiB > {usable / gib:.3g} GiB" in captured.err
    assert main([*argv, "--memory-limit", "80GiB"]) == 0


def test_sweep_help_shows_list_defaults_as_typed(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    flags = text.split("parallel layout:", 1)[1]          # past the usage line
    for flag, default in (("--pp", 4), ("--vpp", 1), ("--microbatches", 8), ("--micro-batch-size", 1)):
        shown = re.search(rf"{flag} A,B \[A,B \.\.\.\].*?\(default: ([^)]*)\)", flags)
        assert shown and shown.group(1) == str(default), flag
    assert "[(" not in text
