"""``pipeexec``: the command line's entry point, dispatching to ``train``, ``compare`` and
``checkpoint`` (and ``calibrate-hardware``). This is the only place that exits the process with a status; the library
raises exceptions."""
from __future__ import annotations

import argparse
import os
import sys

from pipesim.cli.help import DefaultsHelpFormatter, VersionAction, package_version

from .checkpoint import add_commands, run_command
from .compare import compare_main
from .given import GivenFlagsParser
from .profile_flags import add_compare_command
from .train import TRAIN_HELP, add_train_arguments, train_main

DESCRIPTION = ("Run pipesim schedules for real over torch.distributed (gloo on CPU, NCCL on "
               "GPUs): train, checkpoint, and compare predicted with measured.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeexec", description=DESCRIPTION,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--version", action=VersionAction, version_text=_version)
    sub = p.add_subparsers(dest="command", required=True, parser_class=GivenFlagsParser)
    t = sub.add_parser("train", help=TRAIN_HELP, description=TRAIN_HELP,
                       formatter_class=DefaultsHelpFormatter)
    add_train_arguments(t)
    add_commands(sub)
    add_compare_command(sub)
    from .calibrate_hardware import add_command as add_calibrate_hardware
    add_calibrate_hardware(sub)
    from .preprocess import add_command as add_preprocess_data
    add_preprocess_data(sub)
    return p


def _version() -> str:
    import torch

    return f"pipeexec {package_version()} (torch {torch.__version__})"


# exit status after a closed stdout (``pipeexec ... | head``): a shell's for SIGPIPE, 128 + 13
CLOSED_PIPE_STATUS = 141


def main(argv: list[str] | None = None) -> None:
    """Run one command; a reader that closed stdout early (``| head``) ends it quietly with
    status 141, as a command killed by SIGPIPE does, instead of a BrokenPipeError traceback."""
    try:
        try:
            _main(argv)
        finally:
            sys.stdout.flush()         # what is still buffered meets the closed pipe here
    except BrokenPipeError:
        # Python's advice (signal module docs, "Note on SIGPIPE"): point stdout at devnull, so
        # that the interpreter's own flush at exit does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(CLOSED_PIPE_STATUS)


def _main(argv: list[str] | None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["compare"]:
        sys.exit(compare_main(args[1:]))
    if args[:1] == ["train"]:      # errors and usage of train's own parser
        train_main(args[1:])
        return
    ns = _parser().parse_args(args)
    if ns.command == "checkpoint":
        sys.exit(run_command(ns))
    if ns.command == "preprocess-data":
        from .preprocess import run as preprocess_data
        sys.exit(preprocess_data(ns))
    if ns.command == "calibrate-hardware":
        from .calibrate_hardware import run as calibrate_hardware
        sys.exit(calibrate_hardware(ns))
    train_main(args[1:])          # unreachable: train and compare are handled above


if __name__ == "__main__":
    main()
