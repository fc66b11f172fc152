"""Fault injection, for tests of the failure paths: an observer of the runtime.

``--inject raise:RANK:STEP:ACTION`` raises in that action (`InjectedFault`),
``exit:RANK:STEP:ACTION`` kills the process there (SIGKILL), ``hang:RANK:STEP:ACTION`` blocks
there forever; ``overflow:STEP`` puts an inf into one gradient of the last stage at that step
(the Trainer's, not an action's). Never set in normal runs.
"""
from __future__ import annotations

import os
import signal
import time

from pipesim.schedule.action import Action

from .runtime import InjectedFault


def parse_faults(inject: tuple[str, ...], global_rank: int) -> tuple[dict, set[int]]:
    """``raise|exit|hang:RANK:STEP:ACTION`` -> {step: {action: kind}} for this rank; overflow steps."""
    faults: dict[int, dict[str, str]] = {}
    overflow: set[int] = set()
    for spec in inject:
        parts = spec.split(":")
        if parts[0] == "overflow" and len(parts) == 2:
            overflow.add(int(parts[1]))
        elif parts[0] in ("raise", "exit", "hang") and len(parts) == 4:
            if int(parts[1]) == global_rank:
                faults.setdefault(int(parts[2]), {})[parts[3]] = parts[0]
        else:
            raise ValueError(f"bad fault injection {spec!r}: expected raise|exit|hang:RANK:STEP:ACTION "
                             "or overflow:STEP")
    return faults, overflow


class FaultInjector:
    """Runtime observer: at the start of a faulted (step, action), fail as asked."""

    def __init__(self, faults: dict[int, dict[str, str]]) -> None:
        self.faults = faults

    def start(self, action: Action, step: int) -> None:
        kind = self.faults.get(step, {}).get(str(action))
        if kind == "raise":
            raise InjectedFault(f"injected failure in {action} of step {step}")
        if kind == "exit":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            while True:
                time.sleep(3600)
