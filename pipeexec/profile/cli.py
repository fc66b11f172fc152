"""Command-line pieces for profiling: ``--profile`` / ``--trace-out`` of ``pipeexec train`` and
the ``compare`` entry in ``pipeexec --help`` (its flags are parsed by
`pipeexec.profile.compare_cli.compare_main`, which reuses every train flag)."""
from __future__ import annotations

import argparse
from typing import Any


def add_profile_flags(train: argparse.ArgumentParser) -> None:
    g = train.add_argument_group("profiling (predicted vs measured)")
    g.add_argument("--profile", default=None, metavar="A:B",
                   help="time every action of steps A..B-1 (or one step N) on every rank, align "
                        "clocks, count activation memory, and gather one trace on rank 0")
    g.add_argument("--trace-out", default=None, metavar="FILE.json",
                   help="with --profile: write the measured trace as Chrome/Perfetto JSON, "
                        "with FILE.csv and FILE.meta.json beside it")


def profile_from_args(ns: argparse.Namespace) -> Any:
    """`ProfileOptions` from ``--profile`` / ``--trace-out`` (None without --profile)."""
    if getattr(ns, "profile", None) is None:
        if getattr(ns, "trace_out", None):
            raise ValueError("--trace-out needs --profile A:B (the steps to record)")
        return None
    from .session import ProfileOptions

    options = ProfileOptions.parse(ns.profile, ns.trace_out,
                                   cpus_per_rank=getattr(ns, "cpus_per_rank", None))
    options.check(ns.steps)
    return options


def add_compare_command(sub: Any) -> None:
    """List ``compare`` in ``pipeexec --help``; ``pipeexec compare --help`` has the details."""
    sub.add_parser("compare", add_help=False,
                   help="run a schedule with --profile, simulate it with calibrated costs, and "
                        "report predicted vs measured (pipeexec compare --help)")
