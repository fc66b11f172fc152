"""Running a ``pipeexec`` command line in the test's own process.

`run_pipeexec` calls the command's entry point (what ``python3 -m pipeexec`` and the
``pipeexec`` script call) with the line's arguments: the command runs as a user's does and
forks its ranks from here, without a new Python importing torch first for each line (2-3 CPU
seconds a line). A test of the process itself (its exit on a signal, its entry point) starts
one instead.
"""
from __future__ import annotations

import subprocess


def run_pipeexec(argv: list[str], capfd) -> subprocess.CompletedProcess:
    """``pipeexec ARGV`` in this process: its exit status and what it printed (the ranks'
    output too: ``capfd`` captures at the file descriptors, which forked ranks share)."""
    from pipeexec.cli.main import main

    capfd.readouterr()
    try:
        main(argv)
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, status, out, err)
