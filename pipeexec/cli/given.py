"""Which flags a command line gave, the one way every pipeexec command asks it: the line parsed
again over a namespace of sentinels (`pipesim.plan.flags.given_dests`), so a flag set to its
default value still counts as given and a flag left out never does, whatever its default. A
plan file's fields are overridden by the flags given, and only by those."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pipesim.plan.flags import given_dests


class GivenFlagsParser(argparse.ArgumentParser):
    """An ArgumentParser whose namespace also says which flags the command line gave:
    ``ns.given``, their destinations (a sub-command's included: its parser is one too)."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        if namespace is None:                 # (given_dests' own parse brings its sentinels)
            argv = sys.argv[1:] if args is None else list(args)
            # a repeatable flag's list cannot start as a sentinel: it is left out
            flags = [a.dest for a in self._actions
                     if a.option_strings and not isinstance(a.default, list)]
            ns.given = frozenset(given_dests(self, argv, flags)) | getattr(ns, "given",
                                                                           frozenset())
        return ns, rest


def explicit_dests(parser: GivenFlagsParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the flags ``argv`` sets on ``parser`` (abbreviated or
    ``--flag=value`` forms included), as opposed to those left at their defaults."""
    return set(parser.parse_known_args(list(argv))[0].given)
