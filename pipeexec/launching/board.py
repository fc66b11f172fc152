"""Where every rank is: a shared-memory board of (step, action) per rank.

The local launcher creates it before forking; each worker's runtime writes the action it starts
(four integers, no lock: one writer per slot). When a worker dies without a word (SIGKILL, OOM
killer) the launcher still knows, and reports, the action it was in. Under torchrun there is no
board and the runtime names the action in its own exception message.
"""
from __future__ import annotations

import multiprocessing

from pipesim.schedule.op import Op

_FIELDS = 4   # step, op code (pipesim's Op.code), stage, microbatch
# phases outside the schedule's actions, in the op slot (pipesim's op codes are >= 0)
_CHECKPOINT_SAVE, _CHECKPOINT_LOAD = -2, -3


class ActionBoard:
    def __init__(self, world_size: int, ctx=None) -> None:
        ctx = ctx or multiprocessing.get_context("fork")
        self.world_size = world_size
        self._slots = ctx.RawArray("q", [-1] * (world_size * _FIELDS))

    def set(self, rank: int, step: int, op: Op | str, stage: int, microbatch: int) -> None:
        base = rank * _FIELDS
        s = self._slots
        s[base] = step
        s[base + 1] = Op(op).code
        s[base + 2] = stage
        s[base + 3] = microbatch

    def set_checkpoint(self, rank: int, iteration: int, *, load: bool = False) -> None:
        """The rank is saving (or loading) the checkpoint of ``iteration``: a worker killed
        there (out of memory, a full disk's stall) is reported as such, not in the action
        before."""
        base = rank * _FIELDS
        s = self._slots
        s[base] = iteration
        s[base + 1] = _CHECKPOINT_LOAD if load else _CHECKPOINT_SAVE
        s[base + 2] = s[base + 3] = -1

    def describe(self, rank: int) -> str:
        base = rank * _FIELDS
        step, op, stage, mb = self._slots[base: base + _FIELDS]
        if op == _CHECKPOINT_SAVE:
            return f"the checkpoint save of iteration {step}"
        if op == _CHECKPOINT_LOAD:
            return "the checkpoint load, before any action"
        if step < 0:
            return "its start-up, before any action"
        op = Op.of_code(op)
        if op.is_tail:
            return (f"the {'optimizer step' if op is Op.OPTIMIZER else 'gradient all-reduce'} "
                    f"of step {step}")
        if op is Op.OVERLAP_F_B:   # named by its forward part
            return f"the overlapped action with forward {stage}F{mb} (OVERLAP_F_B) of step {step}"
        return f"action {stage}{op}{mb} of step {step}"


class BoardObserver:
    """Runtime observer: writes the action each rank starts onto the board."""

    def __init__(self, board: ActionBoard, rank: int) -> None:
        self.board, self.rank = board, rank

    def start(self, action, step: int) -> None:
        self.board.set(self.rank, step, action.op, action.stage, action.microbatch)
