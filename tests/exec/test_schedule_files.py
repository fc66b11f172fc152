"""Schedules from files in the executor: `pipeexec train --schedule FILE.json|FILE.csv` builds
its config's schedule from the file (checked against the run's layout), and a measured run
records the schedule itself, so a hand-made or searched one is rebuilt exactly."""
import pytest

import pipesim
from pipeexec.config import TrainConfig
from pipeexec.analysis.measured_run import MeasuredRun
from pipesim.schedule.io import schedule_to_csv, schedule_to_dict, schedule_to_json


def test_config_schedule_from_files(tmp_path):
    costs = pipesim.CostModel(forward=1.0, backward_input=2.0, backward_weight=0.5,
                              activation_bytes=1.0)
    searched = pipesim.build_schedule("zb-auto", pp=2, microbatches=4, costs=costs, memory_limit=3)
    dual = pipesim.build_schedule("dualpipev", pp=2, vpp=2, microbatches=4)
    schedule_to_json(searched, tmp_path / "z.json")
    schedule_to_csv(dual, tmp_path / "d.csv", with_comms=True)
    z = TrainConfig.from_flat(schedule=str(tmp_path / "z.json"), pp=2, microbatches=4, layers=4)
    # inserted receives are posted as the run says (--recv-lookahead, 1 by default)
    assert z.validate().build_schedule() == searched.with_recv_lookahead(z.runtime.recv_lookahead)
    d = TrainConfig.from_flat(schedule=str(tmp_path / "d.csv"), pp=2, vpp=2, microbatches=4,
                              layers=4)
    built = d.build_schedule()
    assert built.has_explicit_comms and built.compute_order(0) == dual.compute_order(0)
    assert built.validate(single_channel=True)
    fwd = d.with_flat(forward_only=True).build_schedule()
    assert fwd.forward_only and sum(len(fwd.compute_order(r)) for r in range(2)) == 4 * 4
    with pytest.raises(pipesim.ScheduleError, match=r"d.csv: the schedule has vpp = 2, the run "
                                                    r"vpp = 1; pass --vpp 2"):
        d.with_flat(vpp=1).build_schedule()
    with pytest.raises(pipesim.ScheduleError, match="no such file"):
        TrainConfig.from_flat(schedule=str(tmp_path / "missing.json")).build_schedule()


def test_measured_run_rebuilds_the_schedule_it_ran():
    costs = pipesim.CostModel(forward=1.0, backward_input=2.0, backward_weight=0.5,
                              activation_bytes=1.0)
    searched = pipesim.build_schedule("zb-auto", pp=2, microbatches=4, costs=costs, memory_limit=3)
    default = pipesim.build_schedule("zb-auto", pp=2, microbatches=4)
    assert searched != default            # the name alone would rebuild the wrong one
    meta = {"schedule": "zb-auto", "pp": 2, "vpp": 1, "microbatches": 4,
            "schedule_data": schedule_to_dict(searched)}
    assert MeasuredRun(None, meta).schedule == searched
    del meta["schedule_data"]             # runs recorded before: rebuilt from the name
    assert MeasuredRun(None, meta).schedule == default
