"""``pipeexec train --plan``: a pipesim Plan file and the train flags are two spellings of one
run (the same TrainConfig, whose plan the file is), flags given with a plan override its
fields, and what the executor cannot run is refused, with every reason, before any process
starts."""
from __future__ import annotations

import pytest

import pipesim
from pipesim.plan.model import ModelSpec
from pipesim.plan.parallelism import Parallelism

from pipeexec.cli.train import config_from_args, train_parser

from pipeexec.cli.main import main
from pipeexec.config import ConfigError, TrainConfig

FLAG_RUNS = [
    ["--schedule", "zbv", "--pp", "2", "--vpp", "2", "--microbatches", "4", "--layers", "4"],
    ["--schedule", "interleaved", "--pp", "2", "--vpp", "2", "--dp", "2", "--microbatches", "4",
     "--micro-batch-size", "2", "--layers", "6", "--boundaries", "2,3,6", "--hidden", "32",
     "--heads", "2", "--precision", "bf16"],
    ["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--layers", "2",
     "--recompute", "full", "--recompute-layers", "1"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--recompute", "selective"],
]
REST = ["--steps", "3", "--lr", "0.002", "--seed", "7"]


def from_argv(argv):
    return config_from_args(train_parser().parse_args(argv))


@pytest.mark.parametrize("flags", FLAG_RUNS, ids=lambda f: " ".join(f[1:4]))
def test_flags_and_their_plan_file_give_the_same_config(tmp_path, flags):
    by_flags = from_argv(flags + REST)
    path = tmp_path / "plan.json"
    by_flags.plan_as_run().to_json(path)
    by_file = from_argv(["--plan", str(path)] + REST)
    if by_flags.layout.boundaries is None:
        assert by_file == by_flags
    else:                       # the executor's cut, written into the plan as its partition
        assert by_file == TrainConfig(plan=by_flags.plan_as_run(), layout=by_flags.layout,
                                      inputs=by_flags.inputs, optimizer=by_flags.optimizer,
                                      mixed_precision=by_flags.mixed_precision,
                                      runtime=by_flags.runtime).with_flat(boundaries=None)
        from pipeexec.analysis.predict import layout_of
        assert layout_of(by_file).bounds == layout_of(by_flags).bounds
    # the plan simulates the layout the executor runs: same schedule, same cut
    plan = pipesim.Plan.from_json(path)
    assert plan.build_schedule().name == by_flags.build_schedule().name
    assert sum(plan.stage_layers()) == by_flags.plan.model.layers


def test_a_plan_from_pipesim_runs_its_supported_parts(tmp_path):
    model = ModelSpec(name="tiny", layers=4, hidden=32, heads=4, seq_length=16,
                              vocab=64, tied_embeddings=False, dropout=False)
    plan = pipesim.Plan(model, Parallelism(pp=2, dp=1, micro_batch_size=2,
                                                   global_batch_size=8, precision="fp32"),
                        schedule="1f1b", partition=(1, 3))
    cfg = TrainConfig(plan=plan)
    par, model = cfg.plan.parallelism, cfg.plan.model
    assert (par.pp, cfg.plan.microbatches, par.micro_batch_size, model.layers,
            model.seq_length) == (2, 4, 2, 4, 16)
    from pipeexec.partition import plan_bounds
    assert plan_bounds(plan) == (0, 2, 6)  # stage 0: embedding + 1 block; stage 1: 3 blocks + head
    cfg.validate()


def test_unsupported_parts_are_refused_with_every_reason(tmp_path, capsys):
    plan = pipesim.Plan.create("gpt3-1.3b", "H100", tp=2, pp=2, cp=2, zero=3,
                               recompute="full", global_batch_size=16)
    with pytest.raises(ConfigError) as info:
        TrainConfig(plan=plan).validate()
    text = str(info.value)
    # GPT-3's preset is built as GPT-2's architecture (with its dropout), which cp refuses
    for reason in ("parallelism.cp = 2", "the model has dropout (model.dropout)",
                   "model.vocab = 50257 (--vocab) is not a multiple of tp = 2"):
        assert reason in text
    assert "model.tied_embeddings" not in text     # the executor ties the head to the embedding
    assert "parallelism.zero" not in text and "parallelism.tp" not in text   # both run
    path = tmp_path / "big.json"
    plan.to_json(path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--plan", str(path)])        # refused before any worker starts
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--plan {path}" in err and "parallelism.cp = 2" in err


def test_a_flag_given_with_a_plan_overrides_that_field(tmp_path):
    """One rule in every command: the plan file is the base, a given flag overrides its field
    (the global batch stays the plan's: --dp changes the microbatches, as in pipesim)."""
    path = tmp_path / "plan.json"
    TrainConfig.from_flat(pp=2, microbatches=4, layers=4).plan.to_json(path)
    cfg = from_argv(["--plan", str(path), "--pp", "4", "--layers", "6"])
    assert (cfg.plan.parallelism.pp, cfg.plan.model.layers, cfg.plan.microbatches,
            cfg.plan.model.hidden) == (4, 6, 4, 64)
    assert from_argv(["--plan", str(path), "--microbatches", "8"]).global_batch == 8


def test_fp8_and_every_other_refusal_come_at_once_with_flags(tmp_path, capsys):
    """A plan with fp8 (a bare KeyError before), expert parallelism and a sequence that does
    not cut over cp: one error listing each, with its flag, before any worker starts."""
    path = tmp_path / "fp8.json"
    TrainConfig.from_flat(pp=2, microbatches=2).plan.with_(precision="fp8", ep=2, dp=2,
                                                 cp=3).to_json(path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--plan", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for reason in ("parallelism.precision = 'fp8' (--precision)", "parallelism.ep = 2 (--ep)",
                   "parallelism.cp = 3 (--cp): model.seq_length = 32 (--seq-len)"):
        assert reason in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_train_runs_a_plan_file_as_its_flags(tmp_path, capfd):
    """The same run from flags and from the plan file: the same losses, bitwise (the command
    run in this process: `cli_helpers.run_pipeexec`)."""
    import json

    from cli_helpers import run_pipeexec

    flags = ["--schedule", "zbv", "--pp", "2", "--vpp", "2", "--microbatches", "4",
             "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32"]
    path = tmp_path / "plan.json"
    from_argv(flags).plan.to_json(path)
    losses = []
    for argv, name in ((flags, "flags"), (["--plan", str(path)], "file")):
        out = tmp_path / f"{name}.json"
        done = run_pipeexec(["train", *argv, "--steps", "2", "--no-progress", "--metrics-out",
                             str(out)], capfd)
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(json.loads(out.read_text())["losses"])
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_compare_takes_the_plan_and_refuses_what_train_refuses(tmp_path, capsys):
    from pipeexec.cli.compare import compare_main

    path = tmp_path / "tp.json"
    pipesim.Plan.create("gpt3-1.3b", "H100", cp=2, pp=2, global_batch_size=8).to_json(path)
    assert compare_main(["--plan", str(path)]) == 2        # before any worker starts
    err = capsys.readouterr().err
    assert "parallelism.cp = 2" in err and "pipeexec compare: error" in err


def test_a_plan_holding_its_schedule_as_data_runs_that_schedule(tmp_path):
    """A hand-made schedule inside the plan (ZB-V's, named "interleaved") is what every rank
    builds from the plan file, not what its name would build."""
    from pipesim.schedule.io import schedule_from_dict, schedule_to_dict

    data = schedule_to_dict(pipesim.build_schedule("zbv", pp=2, vpp=2, microbatches=4,
                                                   recv_lookahead=1))
    data["name"] = "interleaved"
    hand = schedule_from_dict(data)
    plan = TrainConfig.from_flat(pp=2, vpp=2, microbatches=4, layers=4).plan
    plan = pipesim.Plan(plan.model, plan.parallelism, plan.cluster, hand, partition=plan.partition)
    path = tmp_path / "hand.json"
    plan.to_json(path)
    cfg = from_argv(["--plan", str(path)])
    assert (cfg.plan.schedule_name == "interleaved"
            and isinstance(cfg.plan.schedule, pipesim.Schedule))
    assert schedule_to_dict(cfg.validate().build_schedule()) == schedule_to_dict(hand)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg      # as a checkpoint stores it
