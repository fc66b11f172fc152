"""A tqdm progress bar that starts no monitor thread.

tqdm's monitor is a background thread; a thread alive in a process that later forks (pipeexec's
local launcher forks its workers from the caller's process) makes the fork unsafe, and the
launcher refuses it. A bar that is updated in a loop needs no watchdog.
"""
from __future__ import annotations

from typing import Any


def progress_bar(*args: Any, **kwargs: Any):
    """``tqdm(*args, **kwargs)`` without the monitor thread."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar(*args, **kwargs)
