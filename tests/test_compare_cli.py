"""``pipeexec compare`` checks the run it is asked for against the calibration run before any
process starts: the model and CPU share come from the calibration run's description unless a
flag sets them, a flag that differs is refused naming every field with both values, and the
defaults make a meaningful comparison (m >= 2 pp, a stage per block at least, several profiled
steps). No worker is started here."""
from __future__ import annotations

import pytest

from pipeexec.cli.given import explicit_dests
from pipeexec.cli.train import train_parser

from pipeexec.cli.main import main
from pipeexec.config import ConfigError, TrainConfig
from pipeexec.cli.compare import DEFAULT_STEPS, compare_defaults
from pipeexec.analysis.run_description import cpu_share, inherit

from test_compare import jittered_run

CAL = TrainConfig.from_flat(schedule="1f1b", pp=4, microbatches=8, layers=6, hidden=256, heads=4,
                            seq_len=128, micro_batch_size=4, steps=4)


def calibration_run(tmp_path, cpus_per_rank=0.5):
    run = jittered_run("1f1b", pp=4, m=8, steps=2)
    run.trace["compute_start"], run.trace["cpu"] = run.trace["start"], float("nan")
    run.meta.update(config=CAL.to_dict(), cpus_per_rank=cpus_per_rank, bounds=[0, 2, 4, 6, 8],
                    layer_kinds=["embedding"] + ["block"] * 6 + ["head"],
                    rank_cpus=[cpus_per_rank or 1.0] * 4, host_cpus=None)
    path = tmp_path / "run_1f1b.json"
    run.save(path)
    return path


def run_cli(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def test_explicit_dests_sees_abbreviations_and_equals_forms():
    p = train_parser()
    assert explicit_dests(p, ["--hid=32", "--pp", "2", "--no-progress"]) == {
        "hidden", "pp", "no_progress"}
    assert explicit_dests(p, []) == set()


def test_inherit_takes_the_model_and_cpu_share_unless_set():
    meta = {"config": CAL.to_dict(), "cpus_per_rank": 0.5}
    target = TrainConfig.from_flat(schedule="zb-h1", pp=2)
    got = inherit(target, {"schedule", "pp"}, meta, cpus_per_rank=None, source="cal.json")
    c = got.config
    model, par = c.plan.model, c.plan.parallelism
    assert (model.layers, model.hidden, model.heads, model.seq_length,
            par.micro_batch_size) == (6, 256, 4, 128, 4)
    assert (c.plan.schedule_name, par.pp) == ("zb-h1", 2) and got.cpus_per_rank == 0.5
    assert {"layers", "hidden", "seq_len", "micro_batch_size", "cpus_per_rank"} <= set(got.taken)
    # the same values given explicitly are no mismatch
    same = inherit(target.with_flat(hidden=256), {"hidden"}, meta, cpus_per_rank=0.5,
                   source="cal.json")
    assert same.config.plan.model.hidden == 256 and same.cpus_per_rank == 0.5


def test_inherit_refuses_every_differing_field_with_both_values():
    meta = {"config": CAL.to_dict(), "cpus_per_rank": 0.5}
    target = TrainConfig.from_flat(layers=6, hidden=512, seq_len=64, precision="bf16")
    with pytest.raises(ConfigError) as info:
        inherit(target, {"layers", "hidden", "seq_len", "precision", "cpus_per_rank"}, meta,
                cpus_per_rank=None, source="cal.json")
    msg = str(info.value)
    assert "cal.json" in msg and "4 field(s)" in msg
    for part in ("--hidden 512 (calibration run: 256)", "--seq-len 64 (calibration run: 128)",
                 "--precision bf16 (calibration run: fp32)",
                 "--cpus-per-rank not confined (calibration run: 0.5)"):
        assert part in msg
    assert "--layers" not in msg                      # equal: not a mismatch
    with pytest.raises(ConfigError, match="does not record its run description"):
        inherit(target, set(), {"schedule": "1f1b"}, cpus_per_rank=None, source="old.json")


def test_cpu_share_of_runs_recorded_before_the_field():
    assert cpu_share({"rank_cpus": [0.5, 0.5]}) == 0.5
    assert cpu_share({"rank_cpus": [1.0, 1.0]}) is None
    assert cpu_share({"cpus_per_rank": None, "rank_cpus": [0.5]}) is None


def test_compare_defaults_make_a_meaningful_run():
    c, said = compare_defaults(TrainConfig.from_flat(schedule="zbv", pp=4, vpp=2),
                               {"schedule", "pp", "vpp"})
    assert (c.plan.microbatches, c.plan.model.layers, c.optimizer.steps) == (8, 6, DEFAULT_STEPS)
    assert (c.plan.model.hidden, c.plan.model.seq_length,
            c.plan.parallelism.micro_batch_size) == (256, 128, 4)    # the benchmark's model
    assert c.validate() and "microbatches 8" in said
    c, _ = compare_defaults(TrainConfig.from_flat(schedule="interleaved", pp=8, vpp=2),
                            {"schedule", "pp", "vpp", "hidden"})
    default = TrainConfig().plan.model
    assert c.plan.model.layers == 14 and c.plan.model.hidden == default.hidden and c.validate()
    # with a calibration run, the model is the run's (inherit) and m at least its m
    c, _ = compare_defaults(TrainConfig.from_flat(pp=2), {"pp"},
                            jittered_run("1f1b", pp=4, m=8, steps=1))
    assert (c.plan.microbatches, c.plan.model.hidden, c.plan.model.layers) == (
        8, default.hidden, default.layers)
    # the user's values stay
    c, said = compare_defaults(TrainConfig.from_flat(pp=2, microbatches=3, steps=3, hidden=32,
                                                     layers=2, heads=4, seq_len=32,
                                                     micro_batch_size=1),
                               {"pp", "microbatches", "steps", "hidden", "layers", "heads",
                                "seq_len", "micro_batch_size"})
    assert (c.plan.microbatches, c.optimizer.steps) == (3, 3) and said == []


def test_compare_refuses_a_mismatch_before_running(tmp_path, capsys):
    path = calibration_run(tmp_path)
    code = run_cli(["compare", "--schedule", "zb-h1", "--pp", "2", "--hidden", "64",
                    "--calibrate-from", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "--hidden 64 (calibration run: 256)" in err, err


def test_compare_names_the_missing_file_the_user_gave(tmp_path, capsys):
    missing = tmp_path / "does_not_exist.json"
    assert run_cli(["compare", "--calibrate-from", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: no such file" in err and ".csv is missing" not in err
    assert run_cli(["compare", "--schedule", "zbv", "--pp", "4", "--vpp", "2", "--layers", "1",
                    "--calibrate-from", str(calibration_run(tmp_path))]) == 2
    assert "--layers 1 (calibration run: 6)" in capsys.readouterr().err


def test_alongside_config_and_its_refusals(tmp_path, capsys):
    from pipeexec.cli.compare import alongside_config

    c = TrainConfig.from_flat(schedule="zbv", pp=2, vpp=2, microbatches=4, layers=2)
    assert (alongside_config(c, "1f1b").plan.schedule_name,
            alongside_config(c, "1f1b").plan.parallelism.vpp) == ("1f1b", 1)
    assert alongside_config(c, "interleaved:2").plan.parallelism.vpp == 2
    with pytest.raises(ValueError, match="expected NAME or NAME:VPP"):
        alongside_config(c, "1f1b:x")
    assert run_cli(["compare", "--alongside", "1f1b",
                    "--calibrate-from", str(calibration_run(tmp_path))]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_alongside_predicts_from_the_partner_steps_of_one_job(tmp_path, capsys):
    import json

    from test_compare import TINY

    report = tmp_path / "r.json"
    assert run_cli(["compare", "--schedule", "zb-h1", *TINY, "--alongside", "1f1b",
                    "--report-out", str(report)]) == 0
    out = capsys.readouterr().out
    assert "predicted from the 1f1b steps of the same job" in out
    data = json.loads(report.read_text())
    assert data["schedule"] == "zb-h1" and data["calibration"]["source"]["schedule"] == "1f1b"
    assert data["compared_steps"] == [1, 2]


def test_a_noisy_calibration_run_is_noted():
    from pipeexec.cli.compare import calibration_spread_note

    run = jittered_run("1f1b", pp=2, m=4, steps=3)
    assert calibration_spread_note(run) == []              # 4% jitter: steady
    late = run.trace["step"] == 2
    # stretch step 2 by half
    t0 = run.trace.loc[late, "start"].min()
    run.trace.loc[late, "end"] = t0 + (run.trace.loc[late, "end"] - t0) * 1.5
    run.trace.loc[late, "start"] = t0 + (run.trace.loc[late, "start"] - t0) * 1.5
    (note,) = calibration_spread_note(run)
    assert "the machine was busy" in note and "--alongside 1f1b" in note


def test_compare_checks_the_cpu_share_before_running(capsys):
    assert run_cli(["compare", "--pp", "2", "--cpus-per-rank", "64"]) == 2
    assert "--cpus-per-rank 64 for 2 rank(s) asks for 128 CPUs" in capsys.readouterr().err


def test_an_inherited_cpu_share_the_machine_cannot_give_says_where_it_came_from(
        tmp_path, capsys, monkeypatch):
    import pipeexec.launching.cpu_quota as cpu_quota

    monkeypatch.setattr(cpu_quota, "_cpu_dir", lambda: None)      # no cgroup CPU controller
    assert run_cli(["compare", "--schedule", "zb-h1", "--pp", "2",
                    "--calibrate-from", str(calibration_run(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "the calibration run's ranks were confined to --cpus-per-rank 0.5" in err


def test_layout_notes_say_ramp_only_where_there_is_a_pipeline():
    from pipeexec.cli.compare import layout_notes

    TINY = TrainConfig.from_flat(layers=4, hidden=16, heads=2, seq_len=8, vocab=32)
    assert layout_notes(TINY.with_flat(pp=1, microbatches=1), 5) == []      # no pipeline: no ramp
    ramp = layout_notes(TINY.with_flat(pp=2, microbatches=2), 5)
    assert len(ramp) == 1 and "ramp-up and ramp-down" in ramp[0]
    assert "profiled step(s)" in layout_notes(TINY.with_flat(pp=1, microbatches=1), 2)[0]
