"""The profiling flags are generated from `ProfileOptions`' fields, and ``pipeexec compare`` runs
what ``pipeexec train`` would for the same model, plan, recompute and profiling flags.

No worker starts: compare's measured run is intercepted where it would launch, after every
option has been resolved and checked.
"""
from __future__ import annotations

import dataclasses

import pytest

from pipeexec.cli.train import config_from_args, train_parser
from pipeexec.flag_fields import flag_of, flagged
from pipeexec.cli import compare as compare_cli
from pipeexec.cli.profile_flags import profile_from_args
from pipeexec.measuring.profile_options import ProfileOptions

TINY = ["--layers", "4", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32",
        "--micro-batch-size", "2"]


def train_ns(argv):
    return train_parser().parse_args(argv)


def test_every_profile_field_with_a_flag_is_a_train_flag_with_its_default():
    parser = train_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    defaults = ProfileOptions()
    for f in flagged(ProfileOptions):
        action = actions[flag_of(f)]
        assert action.help, flag_of(f)
        if f.metadata["cli"].get("fields"):
            assert action.default is None            # not given: no profiling
        elif f.metadata["cli"].get("invert"):
            assert action.default is False and getattr(defaults, f.name) is True
        else:
            assert action.default == getattr(defaults, f.name), flag_of(f)
    assert {flag_of(f) for f in flagged(ProfileOptions)} == {
        "--profile", "--trace-out", "--profile-align-rounds", "--profile-timeout",
        "--no-probe-split"}


def test_flags_give_the_options():
    ns = train_ns([*TINY, "--steps", "4", "--profile", "1:3", "--trace-out", "t.json",
                   "--profile-align-rounds", "4", "--profile-timeout", "30",
                   "--no-probe-split"])
    assert profile_from_args(ns) == ProfileOptions(1, 3, "t.json", None, 4, 30.0, False)
    one = profile_from_args(train_ns([*TINY, "--steps", "4", "--profile", "2"]))
    assert (one.first, one.stop, one.align_rounds, one.probe_split) == (2, 3, 16, True)
    assert profile_from_args(train_ns(TINY)) is None


@pytest.mark.parametrize("argv, message", [
    (["--trace-out", "t.json"], "--trace-out needs --profile A:B"),
    (["--no-probe-split", "--profile-timeout", "5"],
     "--profile-timeout, --no-probe-split need --profile A:B"),
    (["--profile", "1:3", "--profile-align-rounds", "0"], "--profile-align-rounds must be >= 1"),
    (["--profile", "1:3", "--profile-timeout", "0"], "--profile-timeout must be > 0"),
    (["--profile", "3:1"], "need 0 <= A < B"),
    (["--profile", "1:9"], "reaches past the run's 4 step"),
])
def test_bad_profiling_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        profile_from_args(train_ns([*TINY, "--steps", "4", *argv]))


class _Intercepted(ValueError):
    pass


def compare_resolves(monkeypatch, argv):
    """(config, first, stop, ProfileOptions) that ``pipeexec compare argv`` would run."""
    seen = {}

    def fake_run(config, first, stop, **kw):
        seen.update(config=config, first=first, stop=stop, **kw)
        raise _Intercepted("intercepted before launching")
    monkeypatch.setattr(compare_cli, "profiled_run", fake_run)
    assert compare_cli.compare_main(argv) == 2          # the intercept's ValueError
    return seen


def train_config(argv):
    return config_from_args(train_parser().parse_args(argv))


MODEL = ("schedule", "pp", "vpp", "dp", "microbatches", "micro_batch_size", "layers", "hidden",
         "heads", "seq_len", "vocab", "ffn_hidden", "precision", "partition", "boundaries",
         "recompute", "recompute_layers")


def test_compare_runs_trains_model_recompute_and_profiling_flags(monkeypatch, capsys):
    argv = ["--schedule", "interleaved", "--pp", "2", "--vpp", "2", "--microbatches", "4",
            *TINY, "--recompute", "full", "--recompute-layers", "1", "--steps", "3",
            "--profile-align-rounds", "3", "--no-probe-split", "--profile-timeout", "45"]
    seen = compare_resolves(monkeypatch, argv)
    want = train_config(argv)
    for name in MODEL + ("steps",):
        assert seen["config"].to_flat()[name] == want.to_flat()[name], name
    profile = seen["profile"]
    assert (profile.align_rounds, profile.probe_split, profile.timeout) == (3, False, 45.0)
    assert (seen["first"], seen["stop"]) == (1, 3)
    assert "intercepted" in capsys.readouterr().err


def test_compare_runs_a_plan_as_train_does(monkeypatch, tmp_path):
    base = train_config(["--schedule", "zbv", "--pp", "2", "--vpp", "2", "--microbatches", "4",
                         *TINY, "--recompute", "selective"])
    path = tmp_path / "plan.json"
    base.plan.to_json(path)
    seen = compare_resolves(monkeypatch, ["--plan", str(path)])
    want = train_config(["--plan", str(path)])
    for name in MODEL:
        assert seen["config"].to_flat()[name] == want.to_flat()[name], name
    assert (seen["config"].plan.parallelism.recompute == "selective"
            and seen["config"].plan.model.layers == 4)
    # a flag given with the plan overrides its field in both
    seen = compare_resolves(monkeypatch, ["--plan", str(path), "--recompute", "full"])
    assert seen["config"].plan.parallelism.recompute == train_config(
        ["--plan", str(path), "--recompute", "full"]).plan.parallelism.recompute == "full"


def test_profile_options_are_a_value():
    o = ProfileOptions(1, 3)
    assert dataclasses.replace(o, stop=4) == o.replace(stop=4) and o.replace(stop=4).stop == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.first = 2                                       # type: ignore[misc]
