"""A run is a torch-free value: `RunPlan` (schedule as data, partition, layer kinds, hosts and
CPU shares) inside every measured run and checkpoint.

* The measuring room (run_plan, measured, calibrate, contention, predict, compare,
  run_description, plan_memory) imports and works in a process where ``import torch`` fails: a saved run is
  loaded, calibrated, predicted and compared there.
* A hand-made schedule (ZB-V's V placement and order under the name "interleaved", which the
  interleaved builder would place and order differently) survives a plan round trip, a measured
  run and a checkpoint: the run records it, and a resume from the checkpoint puts the same
  layers on each rank and reproduces the uninterrupted run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pipesim
from pipesim.schedule.io import schedule_from_dict, schedule_to_dict

from pipeexec.analysis.run_plan import Layout, RunPlan


def hand_made(pp: int = 2, m: int = 4) -> pipesim.Schedule:
    """ZB-V's schedule named "interleaved": only its data says what it is."""
    data = schedule_to_dict(pipesim.build_schedule("zbv", pp=pp, vpp=2, microbatches=m,
                                                   recv_lookahead=1))
    data["name"] = "interleaved"
    return schedule_from_dict(data).validate()


def test_plan_round_trips_a_hand_made_schedule_through_the_meta():
    s = hand_made()
    named = pipesim.build_schedule("interleaved", pp=2, vpp=2, microbatches=4, recv_lookahead=1)
    assert list(s.placement) != list(named.placement)      # the name alone would mislead
    plan = RunPlan(s, (0, 1, 3, 5, 6), ("embedding",) + ("block",) * 4 + ("head",), dp=2,
                   hosts={"h": {"cpus": 2, "ranks": 4, "rank_cpus": 2.0, "max_rank_cpus": 0.5}},
                   rank_cpus=(0.5, 0.5), host_cpus=2, cpus_per_rank=0.5)
    back = RunPlan.from_meta(plan.to_meta())
    assert schedule_to_dict(back.schedule) == schedule_to_dict(s)
    assert back == RunPlan(back.schedule, *[getattr(plan, f) for f in
                                            ("bounds", "layer_kinds", "dp", "device", "backend",
                                             "hosts", "rank_cpus", "host_cpus", "cpus_per_rank",
                                             "config", "schedule_name")])
    assert back.layout == Layout((0, 1, 3, 5, 6), plan.layer_kinds)


def test_plan_refuses_a_partition_that_does_not_fit_the_schedule():
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(ValueError, match="bounds .* give 3 stages"):
        RunPlan(s, (0, 1, 2, 3), ("block",) * 3)
    with pytest.raises(ValueError, match="3 layer kinds for 4 layers"):
        RunPlan(s, (0, 2, 4), ("block",) * 3)
    meta = RunPlan(s, (0, 1, 2), ("block",) * 2).to_meta()
    meta["pp"] = 4
    with pytest.raises(ValueError, match="schedule_data has pp, vpp, microbatches"):
        RunPlan.from_meta(meta, source="run.meta.json")


TORCH_FREE = textwrap.dedent('''
    import sys
    sys.modules["torch"] = None            # any "import torch" now raises ImportError
    import pandas as pd
    import pipesim
    from pipeexec.analysis import MeasuredRun, RunPlan, compare_runs, predict
    from pipeexec.analysis.calibrate import Layout, calibrate
    from pipeexec.analysis.run_description import cpu_share, inherit

    s = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    truth = pipesim.CostModel(forward=[1.0, 1.5], backward=[2.0, 3.0])
    sim = pipesim.simulate(s, truth)
    t = sim.trace.copy()
    t["op"], t["kind"] = t["op"].astype(str), t["kind"].astype(str)
    frames = []
    for k in range(3):
        f = t.copy()
        f["step"] = k
        f["mem_start"] = f["mem_end"] = 0.0
        f["arrival_observed"] = True
        f["link_start"] = f["compute_start"] = f["start"]
        f["cpu"] = float("nan")
        frames.append(f)
    plan = RunPlan(s, (0, 2, 4), ("embedding", "block", "block", "head"))
    run = MeasuredRun.of_plan(pd.concat(frames, ignore_index=True), plan, profiled_steps=[0, 3])
    run.save(sys.argv[1])
    back = MeasuredRun.load(sys.argv[1])
    assert back.plan.layout == plan.layout and back.schedule.name == "1f1b"
    assert cpu_share(back.meta) is None
    cal = calibrate(back)
    assert abs(cal.costs.compute_times(2)["F"][1] - 1.5) < 1e-9, cal.costs
    other = Layout((0, 1, 4), plan.layer_kinds)
    predicted, _ = predict(pipesim.build_schedule("gpipe", pp=2, microbatches=4), other, back)
    cmp = compare_runs(back)
    assert abs(cmp.predicted.makespan - cmp.measured.makespan) < 1e-6 * cmp.measured.makespan
    from pipeexec.config import TrainConfig
    from pipeexec.analysis.plan_memory import predicted_activation_peaks
    from pipeexec.measuring.profile_options import ProfileOptions
    assert ProfileOptions(1, 3).stop == 3
    peaks = predicted_activation_peaks(TrainConfig.from_flat(pp=2, microbatches=4, layers=4,
                                                             recompute="full"))
    assert len(peaks) == 2 and min(peaks) > 0, peaks
    assert "torch" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    print("ok", predicted.makespan)
''')


def test_measuring_room_works_without_torch(tmp_path):
    root = str(Path(__file__).resolve().parents[1])      # this tree, not an installed copy
    out = subprocess.run([sys.executable, "-c", TORCH_FREE, str(tmp_path / "run.json")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok ")


# -- a hand-made schedule through a real run and a checkpoint -------------------------------------
def hand_made_worker(board, cfg, options, profile_first):
    from pipeexec.checkpoint import CheckpointManager
    from pipeexec.measuring.profile_options import ProfileOptions
    from pipeexec.measuring.session import ProfileSession
    from pipeexec.topology import destroy_topology, init_topology
    from pipeexec.training.train import train
    from pipeexec.run.assemble import assemble

    topo = init_topology(cfg.plan.parallelism.pp, cfg.plan.parallelism.dp, timeout=120)
    try:
        session = None
        if profile_first is not None:
            session = ProfileSession(ProfileOptions(profile_first, cfg.optimizer.steps,
                                                    align_rounds=4), topo)
        trainer = assemble(cfg, topo, board=board,
                           schedule=hand_made(cfg.plan.parallelism.pp, cfg.plan.microbatches),
                           recorder=None if session is None else session.profiler)
        if session is not None:
            session.attach(trainer)
        manager = CheckpointManager(options)
        manager.load(trainer)
        start = trainer.iteration
        res = train(trainer, on_step=manager.on_step)
        manager.finish(trainer)
        run = session.finish(trainer) if session is not None else None
        params = {n: p.detach().clone() for n, p in trainer.named_parameters().items()}
        return {"losses": res.losses, "start": start, "run": run, "params": params}
    finally:
        destroy_topology(topo)


@pytest.mark.slow
def test_hand_made_schedule_survives_a_measured_run_and_a_checkpoint(tmp_path):
    import torch

    from checkpoint_helpers import TINY
    from pipeexec import launch
    from pipeexec.checkpoint import CheckpointOptions
    from pipeexec.checkpoint.reader import CheckpointReader
    from pipeexec.analysis import MeasuredRun

    cfg = TINY.with_flat(schedule="interleaved", pp=2, vpp=2, dp=1, microbatches=4,
                         micro_batch_size=2, steps=4)
    full = launch(hand_made_worker, 2, (cfg, CheckpointOptions(), 1), timeout=300)
    run = full[0]["run"]
    run.save(tmp_path / "run.json")
    measured = MeasuredRun.load(tmp_path / "run.json")
    assert schedule_to_dict(measured.schedule) == schedule_to_dict(hand_made())
    assert measured.plan.layer_kinds == (("embedding",) + ("block",) * cfg.plan.model.layers
                                         + ("head",))

    ckpt = tmp_path / "ckpt"
    launch(hand_made_worker, 2, (cfg.with_flat(steps=2), CheckpointOptions(save=str(ckpt)), None),
           timeout=300)
    reader = CheckpointReader(ckpt)
    assert schedule_to_dict(reader.schedule()) == schedule_to_dict(hand_made())
    v = list(hand_made().placement)              # ZB-V: stages 0 and 3 on rank 0
    assert reader.rank_layers(0) == {i for s in (0, 1, 2, 3) if v[s] == 0
                                     for i in range(reader.layout["bounds"][s],
                                                    reader.layout["bounds"][s + 1])}
    resumed = launch(hand_made_worker, 2, (cfg, CheckpointOptions(load=str(ckpt)), None),
                     timeout=300)
    assert resumed[0]["start"] == 2
    assert resumed[0]["losses"] == full[0]["losses"][2:]       # exact resume: bitwise
    for r in range(2):
        for n, p in full[r]["params"].items():
            assert torch.equal(p, resumed[r]["params"][n]), n
