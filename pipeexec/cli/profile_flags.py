"""Command-line pieces for profiling: the profiling flags of ``pipeexec train`` (generated from
`pipeexec.measuring.profile_options.ProfileOptions`) and
the ``compare`` entry in ``pipeexec --help`` (its flags are parsed by
`pipeexec.cli.compare.compare_main`, which reuses every train flag)."""
from __future__ import annotations

import argparse
from typing import Any

from ..measuring.profile_options import ProfileOptions
from ..flag_fields import add_arguments


def add_profile_flags(train: argparse.ArgumentParser) -> None:
    """The profiling flags, generated from `ProfileOptions`' fields (help and defaults)."""
    add_arguments(train.add_argument_group("profiling (predicted vs measured)"), ProfileOptions)


def profile_from_args(ns: argparse.Namespace) -> ProfileOptions | None:
    """`ProfileOptions` from the profiling flags (None without --profile)."""
    options = ProfileOptions.from_args(ns, cpus_per_rank=getattr(ns, "cpus_per_rank", None))
    if options is not None:
        options.check(ns.steps)
    return options


def add_compare_command(sub: Any) -> None:
    """List ``compare`` in ``pipeexec --help``; ``pipeexec compare --help`` has the details."""
    sub.add_parser("compare", add_help=False,
                   help="run a schedule with --profile, simulate it with calibrated costs, and "
                        "report predicted vs measured (pipeexec compare --help)")
