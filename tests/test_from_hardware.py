"""A run predicted from a hardware file alone, as the run is confined (`pipeexec compare --plan P
--hardware FILE`): a rank on a share c of a core takes 1/c as long for everything; ranks
sharing fewer cores than they are are simulated sharing them."""
from __future__ import annotations

from pathlib import Path

import pytest

import pipesim
from pipeexec.analysis.from_hardware import confined_costs, hardware_prediction
from pipeexec.analysis.predict import EXECUTOR_COMM
from pipeexec.config import TrainConfig

HW = str(Path(__file__).parent / "data" / "cpu_2core_hardware.json")
CFG = TrainConfig.from_flat(schedule="1f1b", pp=2, microbatches=4, layers=4, hidden=64, heads=4,
                            seq_len=32, vocab=64, device="cpu")


def test_a_core_each_is_the_plans_own_step():
    got = hardware_prediction(CFG, HW, cpus_per_rank=None, host_cpus=2)
    plan = CFG.plan_as_run()
    plan = plan.with_(cluster=plan.cluster.with_(hardware=pipesim.hardware.get_hardware(HW)),
                      cp_comm="all_gather")
    sched = CFG.build_schedule()
    want = pipesim.simulate(sched, plan.derive().costs.for_schedule(sched), comm=EXECUTOR_COMM)
    assert got.makespan == pytest.approx(want.makespan, rel=1e-12)
    assert got.share == 1.0 and got.cores is None and "a core of its own" in got.describe()


def test_a_share_of_a_core_stretches_every_time_by_its_inverse():
    whole = hardware_prediction(CFG, HW, cpus_per_rank=1.0, host_cpus=2)
    quarter = hardware_prediction(CFG, HW, cpus_per_rank=0.25, host_cpus=2)
    assert quarter.makespan == pytest.approx(4 * whole.makespan, rel=1e-9)
    assert "0.25 of a core" in quarter.describe()
    costs = pipesim.CostModel(forward=1.0, backward=2.0, p2p_latency=1e-3, p2p_bandwidth=1e9)
    half = confined_costs(costs, 2, 0.5)
    assert half.stage_values("forward", 2) == [2.0, 2.0] and half.p2p_latency == 2e-3
    assert half.p2p_bandwidth == 5e8
    with pytest.raises(ValueError, match="positive"):
        confined_costs(costs, 2, 0.0)


def test_ranks_sharing_fewer_cores_are_simulated_sharing_them():
    cfg = CFG.with_flat(dp=2)                         # 4 ranks, 2 pipelines, on 2 cores
    got = hardware_prediction(cfg, HW, cpus_per_rank=None, host_cpus=2)
    assert got.cores == 1.0 and got.share is None   # the pipeline's half of the 2 cores
    alone = hardware_prediction(cfg, HW, cpus_per_rank=None, host_cpus=8)
    # one core does the two ranks' work one after the other: the step is at least its sum
    assert got.makespan >= sum(alone.result.busy) * (1 - 1e-9) > alone.makespan
    assert "sharing 1 cores" in got.describe()


@pytest.mark.slow
def test_compare_prints_the_hardware_prediction_before_the_run_and_beside_its_figures(tmp_path,
                                                                                      capfd):
    """(The command run in this process: `cli_helpers.run_pipeexec`.)"""
    import json

    from cli_helpers import run_pipeexec

    report = tmp_path / "r.json"
    done = run_pipeexec(
        ["compare", "--hardware", HW, "--pp", "2", "--microbatches", "4", "--layers", "4",
         "--hidden", "64", "--heads", "4", "--seq-len", "32", "--steps", "4", "--no-progress",
         "--report-out", str(report)], capfd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    before = out.index("prediction before running, from ")
    assert before < out.index("step 0") and "before running, measured" in out[before + 1:]
    got = json.loads(report.read_text())["hardware_prediction"]
    assert got["predicted_step_time"] > 0 and got["measured_step_time"] > 0
    assert got["step_time_error"] == pytest.approx(
        got["predicted_step_time"] / got["measured_step_time"] - 1)


def test_zero3_runs_the_executors_program_each_collective_waited_for():
    """The prediction lowers the schedule with the plan's ZeRO actions, as the Trainer does,
    and times them as pipeexec runs them: a stage at once, the rank waiting
    (`predict.EXECUTOR_SHARDING`): no gather before the computation before it has ended (no
    prefetch), and every computation of a stage after its UNSHARD ends."""
    cfg = CFG.with_flat(dp=2, zero=3)
    got = hardware_prediction(cfg, HW, cpus_per_rank=1.0, host_cpus=8)
    t = got.result.trace
    assert got.result.schedule.sharding == cfg.plan_as_run().parallelism.sharding
    assert got.result.costs.overlap_sharding == 0.0
    for r in range(2):
        rows = t[t["rank"] == r].reset_index(drop=True)
        computed = 0.0
        for i, row in rows.iterrows():
            if row["op"] == "UNSHARD":
                assert row["start"] >= computed
                nxt = rows.loc[i + 1:]
                assert nxt[nxt["kind"] == "compute"].iloc[0]["start"] >= row["end"]
            elif row["kind"] == "compute":
                computed = row["end"]
    assert (t["op"] == "REDUCE_GRAD").sum() == 2
