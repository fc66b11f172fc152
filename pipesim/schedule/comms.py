"""Insert SEND/RECV actions around the compute that produces or needs a tensor.

A send goes right after the compute that produced the tensor; a receive goes right before the
compute that needs it. Receiving as early as possible (torch.distributed.pipelining's choice)
makes a rank wait on a peer before it could do useful local work and cascades into bubbles.
Two stages on the same rank (the turn of a V) exchange nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

from .action import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, Action


def insert_comms(order: Sequence[Action], rank: int, placement: Sequence[int]) -> list[Action]:
    """Return ``order`` (compute only, one rank) with communication actions inserted."""
    last = len(placement) - 1
    out: list[Action] = []
    append = out.append
    new = tuple.__new__  # Action(...) without NamedTuple's keyword handling: 4x cheaper
    for action in order:
        op, stage, mb = action
        if op == F:
            if stage > 0 and placement[stage - 1] != rank:
                append(new(Action, (RECV_F, stage, mb)))
            append(action)
            if stage < last and placement[stage + 1] != rank:
                append(new(Action, (SEND_F, stage, mb)))
        elif op == B or op == I:
            if stage < last and placement[stage + 1] != rank:
                append(new(Action, (RECV_B, stage, mb)))
            append(action)
            if stage > 0 and placement[stage - 1] != rank:
                append(new(Action, (SEND_B, stage, mb)))
        else:
            append(action)
    return out


def peer_stage(action: Action) -> int:
    """The stage at the other end of a SEND/RECV action."""
    op, stage = action.op, action.stage
    if op == SEND_F or op == RECV_B:
        return stage + 1
    return stage - 1  # RECV_F, SEND_B
