"""The action IR shared by the simulator and the executor.

An action is ``(op, stage, microbatch)``. Its text form is the compact notation of
``torch.distributed.pipelining`` (``2F5``, ``0I3``, ``1SEND_F0``), so schedules written for torch
read the same here.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from ..errors import ScheduleError

F, B, I, W = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"

COMPUTE_OPS = frozenset((F, B, I, W))
COMM_OPS = frozenset((SEND_F, RECV_F, SEND_B, RECV_B))
ALL_OPS = COMPUTE_OPS | COMM_OPS
BACKWARD_OPS = frozenset((B, I, W))

# Longest alternatives first so "SEND_F" is not read as "S" + junk.
_ACTION_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)\s*$")


class Action(NamedTuple):
    """One step of one rank: ``op`` on ``stage`` for ``microbatch``.

    A NamedTuple: immutable, hashable, and cheap to create and unpack in hot loops.
    For SEND/RECV, ``stage`` is the stage that runs on this rank (the sender for SEND_*,
    the receiver for RECV_*), as in torch.distributed.pipelining.
    """

    op: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.op!r}, {self.stage}, {self.microbatch})"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the compact text form, e.g. ``"2F5"`` or ``"1SEND_F0"``."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><op><microbatch> with op one of "
                f"{', '.join(sorted(ALL_OPS))}, e.g. '2F5'"
            )
        return cls(match.group(2), int(match.group(1)), int(match.group(3)))
