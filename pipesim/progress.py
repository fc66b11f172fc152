"""A tqdm progress bar that starts no monitor thread and draws only on a terminal.

tqdm's monitor is a background thread; a thread alive in a process that later forks (pipeexec's
local launcher forks its workers from the caller's process) makes the fork unsafe, and the
launcher refuses it. A bar that is updated in a loop needs no watchdog. Written to a file or a
pipe, a bar's carriage returns would mix its frames into the log lines around it, so there it
is off.
"""
from __future__ import annotations

import sys
from typing import Any


def progress_bar(*args: Any, **kwargs: Any):
    """``tqdm(*args, **kwargs)`` without the monitor thread, disabled unless its stream (``file``,
    default stderr) is a terminal."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    if not _is_terminal(kwargs.get("file") or sys.stderr):
        kwargs["disable"] = True
    return Bar(*args, **kwargs)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):       # no isatty, or a closed stream
        return False
