"""One table of layout, batch and model flags (`pipesim.plan.flags.PLAN_FLAGS`) for every
command: the same set, the same names and the same help in `pipesim simulate`, `pipesim plan`,
`pipeexec train` and `pipeexec compare`; lists read the same everywhere; a plan file is the
base that given flags override, in both packages."""
import argparse

import pytest

from pipesim.cli import build_parser
from pipesim.cli import main as pipesim_main
from pipesim.plan.flags import BY_DEST, DESTS, PLAN_FLAGS, apply_flags, given_dests, values


def _pipesim_parser(argv: list[str]) -> argparse.ArgumentParser:
    return build_parser().parse_args(argv).parser


def _table_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest in BY_DEST}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    out = {"pipesim simulate": _pipesim_parser(["simulate"]),
           "pipesim plan": _pipesim_parser(["plan", "--gpus", "8"])}
    torch = pytest.importorskip("torch")
    assert torch
    from pipeexec.cli.compare import compare_parser
    from pipeexec.cli.train import train_parser

    out["pipeexec train"] = train_parser()
    out["pipeexec compare"] = compare_parser()
    return out


def test_the_four_commands_take_the_same_layout_batch_and_model_flags_with_the_same_help():
    parsers = _parsers()
    for command, parser in parsers.items():
        actions = _table_actions(parser)
        assert set(actions) == set(DESTS), (command, set(DESTS) ^ set(actions))
        for dest, action in actions.items():
            f = BY_DEST[dest]
            names = {f.flag, *f.aliases}
            if f.boolean:
                names.add("--no-" + f.flag[2:])
            assert set(action.option_strings) == names, (command, dest, action.option_strings)
            assert action.help == f.help, (command, dest)
            if f.choices is not None and action.nargs != "+":
                assert tuple(action.choices) == f.choices, (command, dest)
    # `pipesim plan` searches the searchable knobs (several values each), the rest take one
    plan = _table_actions(parsers["pipesim plan"])
    assert {d for d, a in plan.items() if a.nargs == "+"} == {f.dest for f in PLAN_FLAGS
                                                             if f.searchable}


def test_no_other_flag_of_the_four_commands_sets_a_plan_field_under_another_name():
    """A flag outside the table that spells a table field (--gbs as its own flag, --seq,
    --ffn-mult, --hf-model...) would be a second name of one fact."""
    other_names = {"--seq", "--gbs", "--mbs", "--ffn-mult", "--num-layers", "--hidden-size"}
    for command, parser in _parsers().items():
        for action in parser._actions:
            if action.dest in BY_DEST:
                continue
            clash = set(action.option_strings) & other_names
            assert not clash, (command, clash)


@pytest.mark.parametrize("argv", [["--pp", "2,4"], ["--pp", "2", "4"], ["--pp", "2", "--pp", "4"]])
def test_lists_read_the_same_whichever_way_they_are_written(argv):
    from pipesim.plan.flags import flatten

    parser = _pipesim_parser(["plan", "--gpus", "8"])
    ns = parser.parse_args(["--gpus", "8", *argv])
    assert flatten(ns.pp) == (2, 4)


def test_schedules_lists_in_sweep_and_plan_take_commas_and_spaces(tmp_path, capsys):
    for words in (["1f1b,zb-h1"], ["1f1b", "zb-h1"]):
        out = tmp_path / "s.csv"
        assert pipesim_main(["sweep", "--schedules", *words, "--pp", "2", "-m", "4",
                             "--out", str(out), "--no-progress"]) == 0
        text = out.read_text()
        assert "1f1b" in text and "zb-h1" in text
    with pytest.raises(argparse.ArgumentTypeError, match="no value"):
        values(str)(",")


def test_a_plan_file_is_the_base_and_given_flags_override_it(tmp_path):
    import pipesim

    plan = pipesim.Plan.create("tiny", "H100", pp=2, dp=2, micro_batch_size=2,
                               global_batch_size=16, schedule="1f1b")
    parser = _pipesim_parser(["simulate"])
    argv = ["--plan", "p.json", "--tp", "2", "-m", "8", "--seq-len", "256", "--layers", "4"]
    ns = parser.parse_args(argv)
    given = given_dests(parser, argv)
    assert given == {"tp", "microbatches", "seq_len", "layers"}     # --plan is not a table flag
    out = apply_flags(plan, ns, given)
    assert out.parallelism.tp == 2 and out.parallelism.pp == 2 and out.parallelism.dp == 2
    assert out.parallelism.global_batch_size == 8 * 2 * 2            # m x mbs x dp
    assert out.model.seq_length == 256 and out.model.layers == 4
    assert out.model.hidden == plan.model.hidden                      # not given: the file's
    with pytest.raises(pipesim.PlanError, match="not both"):
        apply_flags(plan, parser.parse_args(["-m", "2", "--global-batch-size", "8"]),
                    {"microbatches", "global_batch_size"})


def test_simulate_of_a_saved_plan_with_an_override_equals_the_flags_alone(tmp_path, capsys):
    """`--plan P --vpp 2` and the same layout spelled with flags alone are one plan."""
    import json

    base = ["simulate", "1f1b", "--model", "tiny", "--pp", "2", "--dp", "2", "-m", "4"]
    assert pipesim_main([*base, "--save-plan", str(tmp_path / "a.json")]) == 0
    assert pipesim_main(["simulate", "interleaved", "--plan", str(tmp_path / "a.json"), "--vpp",
                         "2", "--save-plan", str(tmp_path / "b.json")]) == 0
    assert pipesim_main(["simulate", "interleaved", "--model", "tiny", "--pp", "2", "--dp", "2",
                         "-m", "4", "--vpp", "2", "--save-plan", str(tmp_path / "c.json")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    c = json.loads((tmp_path / "c.json").read_text())
    assert b == c


def test_the_same_words_give_pipesim_and_pipeexec_the_same_layout_batch_and_model():
    """`pipesim simulate` and `pipeexec train` read one command line into one Plan: same
    parallelism, same global batch, same model shape."""
    pytest.importorskip("torch")
    from pipeexec.cli.train import config_from_args, train_parser
    from pipesim.cli.plan_cmds import plan_from_args

    words = ["--model", "tiny", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len",
             "32", "--vocab", "256", "--pp", "2", "--vpp", "2", "--dp", "2", "-m", "4",
             "--micro-batch-size", "2", "--precision", "fp32", "--recompute", "full"]
    sim_parser = _pipesim_parser(["simulate"])
    ns = sim_parser.parse_args(["interleaved", *words])
    simulated = plan_from_args(ns, given_dests(sim_parser, ["interleaved", *words]))
    trained = config_from_args(train_parser().parse_args(["--schedule", "interleaved", *words]))
    ran = trained.plan
    for field in ("tp", "cp", "ep", "pp", "vpp", "dp", "micro_batch_size", "gbs", "recompute",
                  "precision", "zero", "sequence_parallel"):
        assert getattr(ran.parallelism, field) == getattr(simulated.parallelism, field), field
    for field in ("layers", "hidden", "heads", "seq_length", "vocab", "ffn", "num_kv_heads"):
        assert getattr(ran.model, field) == getattr(simulated.model, field), field
