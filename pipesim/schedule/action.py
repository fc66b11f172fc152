"""The action IR shared by the simulator and the executor.

An action is ``(op, stage, microbatch)``. Its text form is the compact notation of
``torch.distributed.pipelining`` (``2F5``, ``0I3``, ``1SEND_F0``), so schedules written for torch
read the same here.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from ..errors import ScheduleError
from .op import Op

# The one Op enum's values (plain strings, equal to its members: an exact str keys dicts and
# compares fastest in the hot loops that read actions), under their short names.
F, B, I, W = Op.F.value, Op.B.value, Op.I.value, Op.W.value  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = Op.SEND_F.value, Op.RECV_F.value, Op.SEND_B.value, Op.RECV_B.value
OVERLAP_F_B = Op.OVERLAP_F_B.value
UNSHARD, RESHARD, REDUCE_GRAD = Op.UNSHARD.value, Op.RESHARD.value, Op.REDUCE_GRAD.value

BASIC_COMPUTE_OPS = frozenset((F, B, I, W))
COMPUTE_OPS = BASIC_COMPUTE_OPS | {OVERLAP_F_B}
COMM_OPS = frozenset((SEND_F, RECV_F, SEND_B, RECV_B))
# ZeRO as actions (`pipesim.schedule.sharding`): on a stage, for the microbatch of the compute
# they serve (-1: none, torch's text form without a microbatch, ``0UNSHARD``)
SHARD_OPS = frozenset((UNSHARD, RESHARD, REDUCE_GRAD))
ALL_OPS = COMPUTE_OPS | COMM_OPS | SHARD_OPS
BACKWARD_OPS = frozenset((B, I, W))

# Longest alternatives first so "SEND_F" is not read as "S" + junk.
_ACTION_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)\s*$")
_SHARD_RE = re.compile(r"^\s*(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)(\d*)\s*$")
_OVERLAP_RE = re.compile(r"^\s*\(([^()]*)\)OVERLAP_F_B\s*$")


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
        if self.microbatch < 0:             # a sharding op for no one microbatch (torch's form)
            return f"{self.stage}{self.op}"
        return f"{self.stage}{self.op}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.op!r}, {self.stage}, {self.microbatch})"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def parts(self) -> tuple["Action", ...]:
        """The basic actions this action runs: itself, or an overlap's sub-actions."""
        return (self,)

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS

    @property
    def is_shard(self) -> bool:
        """UNSHARD, RESHARD or REDUCE_GRAD (`pipesim.schedule.sharding`)."""
        return self.op in SHARD_OPS

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the compact text form, e.g. ``"2F5"``, ``"1SEND_F0"`` or torch's
        ``"(0F3;2B1)OVERLAP_F_B"``."""
        overlap = _OVERLAP_RE.match(text)
        if overlap is not None:
            return Overlap(*(cls.parse(part) for part in overlap.group(1).split(";")))
        match = _ACTION_RE.match(text)
        if match is None:
            shard = _SHARD_RE.match(text)
            if shard is not None:
                mb = shard.group(3)
                return cls(Op(shard.group(2)).value, int(shard.group(1)), int(mb) if mb else -1)
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><op><microbatch> with op one of "
                f"{', '.join(sorted(ALL_OPS))}, e.g. '2F5'"
            )
        return cls(Op(match.group(2)).value, int(match.group(1)), int(match.group(3)))


class Overlap(Action):
    """A forward and a backward run as one action (DeepSeek's DualPipe "overlapped F&B";
    torch.distributed.pipelining's ``OVERLAP_F_B``), text ``"(0F3;2B1)OVERLAP_F_B"``.

    ``parts`` is ``(forward, backward)``: one F, then one B or I, of any stages of this rank.
    The action starts once the inputs of both parts are there (its receives are posted before
    it, its sends follow it), and its parts must not depend on each other, so that a device
    may run them at the same time (the compute of one hiding the communication of the other).
    As a tuple it reads ``(OVERLAP_F_B, stage, microbatch)`` of its forward, so code that only
    unpacks actions keeps working; code that runs actions reads ``parts``.
    """

    def __new__(cls, forward: Action, backward: Action) -> "Overlap":
        for part in (forward, backward):
            if not isinstance(part, Action) or isinstance(part, Overlap):
                raise ScheduleError(f"OVERLAP_F_B: part {part!r} is not a basic action")
        if forward.op != F or backward.op not in (B, I):
            raise ScheduleError(
                f"OVERLAP_F_B ({forward};{backward}): expected a forward F then a backward B or I, "
                f"got {forward.op} then {backward.op}")
        self = tuple.__new__(cls, (OVERLAP_F_B, forward.stage, forward.microbatch))
        self.__dict__["_parts"] = (forward, backward)
        return self

    def __getnewargs__(self):  # pickling and copying rebuild it from its parts
        return self._parts

    @property
    def parts(self) -> tuple[Action, Action]:
        return self._parts

    @property
    def forward(self) -> Action:
        return self._parts[0]

    @property
    def backward(self) -> Action:
        return self._parts[1]

    def __setattr__(self, name, value):
        raise AttributeError(f"Overlap is immutable (cannot set {name!r})")

    def __str__(self) -> str:
        return f"({self._parts[0]};{self._parts[1]}){OVERLAP_F_B}"

    def __repr__(self) -> str:
        return f"Overlap({self._parts[0]!r}, {self._parts[1]!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Overlap):
            return self._parts == other._parts
        return False if isinstance(other, tuple) else NotImplemented

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __hash__(self) -> int:
        return hash((OVERLAP_F_B,) + self._parts)


def flat_parts(actions) -> list[Action]:
    """``actions`` with every overlap replaced by its parts, in order."""
    out: list[Action] = []
    for a in actions:
        if a.op == OVERLAP_F_B:
            out.extend(a.parts)
        else:
            out.append(a)
    return out
