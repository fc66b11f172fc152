"""Command-line face of checkpointing: the ``--save/--load`` flags of ``pipeexec train`` and
the ``pipeexec checkpoint inspect|convert`` commands. `pipeexec.cli` mounts both."""
from __future__ import annotations

import argparse
import sys

import pipesim
from pipesim.cli.help import DefaultsHelpFormatter

from ..config import ConfigError
from ..flag_fields import add_arguments, values_from_args
from ..checkpoint.convert import convert_checkpoint
from .export_flags import add_export_command, run_export
from ..checkpoint.errors import CheckpointError
from ..checkpoint.inspect import describe
from ..checkpoint.layout import RELEASE
from ..checkpoint.manager import CheckpointOptions


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """The checkpointing flags, generated from `CheckpointOptions`' fields."""
    add_arguments(parser.add_argument_group("checkpointing (Megatron-LM layout)"),
                  CheckpointOptions)


def options_from_args(ns: argparse.Namespace) -> CheckpointOptions:
    return CheckpointOptions(**values_from_args(CheckpointOptions, ns)).validate()


def _tag(value: str | None):
    if value is None or value == RELEASE:
        return value
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"--iteration must be a number or {RELEASE!r}, got {value!r}")
    return int(value)


def add_commands(subparsers) -> None:
    """``checkpoint inspect DIR`` and ``checkpoint convert SRC DST --pp ...``."""
    fmt = DefaultsHelpFormatter
    c = subparsers.add_parser("checkpoint", help="inspect or convert checkpoints",
                              formatter_class=fmt)
    sub = c.add_subparsers(dest="checkpoint_command", required=True)
    i = sub.add_parser("inspect", help="print what a checkpoint directory holds",
                       formatter_class=fmt)
    i.add_argument("dir", help="a --save directory (with latest_checkpointed_iteration.txt)")
    i.add_argument("--iteration", type=_tag, default=None,
                   help=f"an iteration number or {RELEASE!r} (default: the tracker's)")
    i.add_argument("--no-verify", action="store_true", help="skip the CRC-32 check of every file")
    v = sub.add_parser("convert", help="rewrite a checkpoint for another pp/vpp/dp/schedule",
                       formatter_class=fmt)
    v.add_argument("src", help="the checkpoint directory to read")
    v.add_argument("dst", help="the directory to write (a new Megatron-layout checkpoint)")
    v.add_argument("--iteration", type=_tag, default=None,
                   help=f"an iteration number or {RELEASE!r} (default: the tracker's)")
    keep = " (default: the source's)"
    v.add_argument("--pp", type=int, default=None, help="pipeline ranks" + keep)
    v.add_argument("--vpp", type=int, default=None, help="stages per pipeline rank" + keep)
    v.add_argument("--dp", type=int, default=None, help="data-parallel replicas" + keep)
    v.add_argument("--schedule", default=None, help="schedule name" + keep)
    v.add_argument("--microbatches", type=int, default=None, help="microbatches per step" + keep)
    v.add_argument("--partition", choices=("layers", "params"), default=None,
                   help="how layers are cut into stages" + keep)
    v.add_argument("--boundaries", default=None,
                   help="first layer of stages 1..S-1, comma separated" + keep)
    add_export_command(sub, fmt, _tag)


def run_command(ns: argparse.Namespace) -> int:
    """Run a parsed ``checkpoint`` command; print errors; return the exit status."""
    try:
        if ns.checkpoint_command == "inspect":
            print(describe(ns.dir, ns.iteration, verify=not ns.no_verify))
        elif ns.checkpoint_command == "export-hf":
            run_export(ns, log=print)
        else:
            boundaries = None
            if ns.boundaries:
                boundaries = tuple(int(x) for x in ns.boundaries.split(","))
            convert_checkpoint(ns.src, ns.dst, tag=ns.iteration, pp=ns.pp, vpp=ns.vpp, dp=ns.dp,
                               schedule=ns.schedule, microbatches=ns.microbatches,
                               partition=ns.partition, boundaries=boundaries, log=print)
    except (CheckpointError, ConfigError, pipesim.ScheduleError, ValueError) as exc:
        print(f"pipeexec checkpoint: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`pipeexec checkpoint inspect DIR | head`): not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipeexec")
    add_commands(p.add_subparsers(dest="command", required=True))
    return run_command(p.parse_args(argv))
