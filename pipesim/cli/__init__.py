"""`pipesim` command line: one module per group of sub-commands, each exposing ``add_commands``.

Library code raises; only :func:`main` turns an error into a message and an exit status.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..errors import ScheduleError
from .help import DefaultsHelpFormatter, VersionAction, package_version

# Modules that add sub-commands; each has add_commands(subparsers) and sets args.func.
_COMMAND_MODULES = ("pipesim.cli.schedule_cmds", "pipesim.cli.simulate_cmds",
                    "pipesim.cli.plan_cmds", "pipesim.cli.planner_cmds")


class _Parser(argparse.ArgumentParser):
    """Sub-command parsers show every flag's default in their help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipesim", description="Pipeline-parallel schedules as data, and their simulation.",
        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action=VersionAction,
                        version_text=lambda: f"pipesim {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    full = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(full)
    # the sub-command's own words, for what a flag given on the line overrides
    args.command_argv = full[full.index(args.command) + 1:] if args.command in full else []
    try:
        return int(args.func(args) or 0)
    except (ScheduleError, ValueError, FileNotFoundError) as exc:
        print(f"pipesim {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT, as pipeexec does (a process
        # pool's workers ignore SIGINT, so they print nothing either)
        print(f"\npipesim {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        # The reader went away (`pipesim show ... | head`): not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
