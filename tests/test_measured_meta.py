"""A measured run's meta is read through typed fields (`RunPlan`, `Measurement`), and the file
format did not move: a run written by the code at commit 8ef147e (tests/data/
measured_run_8ef147e, how it was made in its expected.json) loads and reads as that code read
it, and writing its values again gives the same meta, key for key."""
import json
import math
from pathlib import Path

import pytest

import pipesim
from pipeexec.analysis.contention import shares_cores
from pipeexec.analysis.measured_run import MeasuredRun
from pipeexec.analysis.profile_meta import Measurement, StageProbe
from pipeexec.analysis.predict import predict
from pipeexec.analysis.run_description import cpu_share

OLD = Path(__file__).parent / "data" / "measured_run_8ef147e"


@pytest.fixture(scope="module")
def expected():
    return json.loads((OLD / "expected.json").read_text())


def test_a_run_written_before_the_typed_meta_loads_and_reads_the_same(expected):
    run = MeasuredRun.load(OLD / "run.json")
    assert run.steps == expected["steps"]
    assert {str(k): v for k, v in run.makespans().items()} == expected["makespans"]
    assert run.schedule.name == expected["schedule"]
    assert list(run.plan.bounds) == expected["bounds"]
    assert list(run.plan.layout.layer_kinds) == expected["layer_kinds"]
    assert cpu_share(run.meta) == expected["cpu_share"]
    assert shares_cores(run.plan) is expected["shares_cores"]
    m = run.measurement
    assert list(m.clock_offsets) == expected["clock_offsets"]
    assert list(m.profiled_steps) == expected["profiled_steps"]
    assert sorted(str(s) for s in m.split_probe) == expected["split_probe_stages"]
    assert m.memory == "held_tensors"
    target = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    res, cal = predict(target, run.plan.layout, run)
    assert cal.model == expected["calibration_model"]
    assert res.makespan == pytest.approx(expected["predicted_1f1b_makespan"], rel=1e-9)


def test_writing_the_typed_values_again_gives_the_old_meta_key_for_key(tmp_path):
    old = MeasuredRun.load(OLD / "run.json")
    again = MeasuredRun.of_plan(old.trace, old.plan, old.measurement)
    assert again.meta == old.meta and list(again.meta) == list(old.meta)
    again.save(tmp_path / "run.json")
    assert json.loads((tmp_path / "run.meta.json").read_text()) == \
        json.loads((OLD / "run.meta.json").read_text())


def test_measurement_defaults_for_keys_a_file_lacks_and_a_bad_one_names_the_file(tmp_path):
    m = Measurement.from_meta({"schedule": "1f1b"})
    assert m == Measurement() and m.to_meta() == {}
    probe = StageProbe.from_meta({"ratio_wall": {"I": 0.25}})
    assert probe.freed_at_I is None and probe.ratios("wall")[0] == 0.25
    assert math.isnan(probe.ratios("wall")[1]) and math.isnan(probe.ratios("cpu")[0])
    for name in ("run.csv", "run.meta.json"):
        (tmp_path / name).write_bytes((OLD / name).read_bytes())
    meta = json.loads((tmp_path / "run.meta.json").read_text())
    meta["profiled_steps"] = 3
    (tmp_path / "run.meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"run\.meta\.json: unreadable measurement keys"):
        MeasuredRun.load(tmp_path / "run.json")


def test_the_typed_view_follows_changes_to_the_stored_meta():
    run = MeasuredRun.load(OLD / "run.json")
    assert 1 in run.measurement.split_probe
    del run.meta["split_probe"]
    assert run.measurement.split_probe == {}
    with pytest.raises(TypeError, match="not both"):
        MeasuredRun.of_plan(run.trace, run.plan, Measurement(), memory="held_tensors")
