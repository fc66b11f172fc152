"""Both command lines explain every flag and show its default, and answer --version."""
from __future__ import annotations

import argparse

import pytest

from pipeexec.cli.main import _parser as pipeexec_parser
from pipeexec.cli.main import main as pipeexec_main
from pipeexec.cli.compare import compare_parser
from pipesim.cli import build_parser as pipesim_parser
from pipesim.cli import main as pipesim_main


def commands(parser, path=()):
    """(path, parser) of the parser and every sub-command under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


PARSERS = [*commands(pipesim_parser(), ("pipesim",)), *commands(pipeexec_parser(), ("pipeexec",)),
           (("pipeexec", "compare (own flags)"), compare_parser())]


@pytest.mark.parametrize("path, parser", PARSERS, ids=[" ".join(p) for p, _ in PARSERS])
def test_every_flag_has_help_and_shows_its_default(path, parser):
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{' '.join(path)}: {action.option_strings or action.dest} has no help"
        default = action.default
        if action.option_strings and default not in (None, False, [], argparse.SUPPRESS):
            shown = f"(default: {default})"
            assert shown in " ".join(text.split()) or "default" in action.help, \
                f"{' '.join(path)}: {action.option_strings} does not show {shown}"
    assert "``" not in text


def test_train_help_shows_the_defaults_a_newcomer_needs(capsys):
    with pytest.raises(SystemExit):
        pipeexec_main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    # the plan flags' help is pipesim's table's; their defaults the base plan's
    assert "transformer layers (blocks) (default: 2)" in text
    assert "microbatches x micro-batch-size x dp) (default: 1)" in text


def test_unknown_train_flag_prints_trains_usage(capsys):
    with pytest.raises(SystemExit) as info:
        pipeexec_main(["train", "--layer", "3", "--bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: pipeexec train")
    assert "unrecognized arguments: --bogus" in err


def test_version(capsys):
    with pytest.raises(SystemExit):
        pipesim_main(["--version"])
    assert capsys.readouterr().out.startswith("pipesim ")
    with pytest.raises(SystemExit):
        pipeexec_main(["--version"])
    out = capsys.readouterr().out
    assert out.startswith("pipeexec ") and "torch" in out
