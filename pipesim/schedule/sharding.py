"""ZeRO as actions: a lowering pass that inserts ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``.

torch.distributed.pipelining's IR has these three (``_add_unshard_reshard``,
``_add_reduce_grad``); here they are inserted into each rank's action list the way
`pipesim.schedule.comms` inserts sends and receives: a pure function of the rank's actions and
the run's `Sharding` (the plan's ``zero`` and ``grad_reduce``), applied by
`Schedule.actions` when the schedule carries one (`Schedule.with_sharding`), so the executor
runs them and the simulator times them from the same lowered program.

The unit an action acts on is a stage: its flat parameter buffer (UNSHARD, RESHARD) or its
gradient buffer (REDUCE_GRAD), every bucket of it (the executor's buckets, a layer each, are
reduced in bucket order; its microbatch field names the microbatch of the compute it serves).

* ZeRO-3 (``level`` 3): ``UNSHARD s`` right before every compute action of stage ``s``
  (all-gather its weights), ``RESHARD s`` right after it (release them: no communication), so a
  stage's weights are whole only during its own actions (PyTorch FSDP1's reshard after forward
  and backward; torch's ``_add_unshard_reshard(max_active_stages=1)`` keeps them between
  consecutive actions of one stage, which is this list with every ``RESHARD s, UNSHARD s`` pair
  dropped). An overlap gathers both parts' stages before it and releases them after.
* ZeRO-2/3 (``level`` >= 2): ``REDUCE_GRAD s`` reduce-scatters stage ``s``'s gradients.
  ``grad_reduce="per_step"`` (Megatron's, FSDP's under gradient accumulation; torch's
  ``_add_reduce_grad``): once, right after the stage's last backward action of the step (a B or
  a W: every I precedes its own W). ``"per_microbatch"`` (DeepSpeed's ZeRO-2): after every B and
  every W of the stage (an I's few parameter gradients are reduced with its W's).
  The reduction comes before the RESHARD of the same action.
* Both come after the compute's sends (a send goes out as soon as its tensor exists); the
  UNSHARD right before the compute, after its receives are posted.
* ZeRO-1 (and 0) insert nothing: the gradients are reduced once, in the step's tail (``ALLREDUCE``),
  after the whole backward, as before.

Sends stay right after the compute that produced their tensor; receives stay where they were.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ScheduleError
from .action import (B, BASIC_COMPUTE_OPS, I, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, SHARD_OPS,
                     UNSHARD, W, Action)

GRAD_REDUCE = ("per_step", "per_microbatch")
_MAKES_WEIGHT_GRADS = frozenset((B, W))
_BACKWARD = frozenset((B, I, W))
_SENDS = frozenset((SEND_F, SEND_B))


@dataclass(frozen=True)
class Sharding:
    """What a run shards over its data-parallel group: ZeRO ``level`` 0-3 and, for 2 and 3,
    when the gradients are reduced (``grad_reduce``: ``per_step`` or ``per_microbatch``)."""

    level: int = 0
    grad_reduce: str = "per_step"

    def __post_init__(self) -> None:
        if self.level not in (0, 1, 2, 3) or isinstance(self.level, bool):
            raise ScheduleError(f"sharding: ZeRO level must be 0, 1, 2 or 3, got {self.level!r}")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ScheduleError(f"sharding: grad_reduce must be one of {', '.join(GRAD_REDUCE)}, "
                                f"got {self.grad_reduce!r}")

    @property
    def inserts(self) -> bool:
        """True when the pass inserts anything (ZeRO-2 and 3)."""
        return self.level >= 2

    def to_dict(self) -> dict:
        return {"zero": self.level, "grad_reduce": self.grad_reduce}

    @classmethod
    def from_dict(cls, data: dict) -> "Sharding":
        return cls(int(data.get("zero", 0)), data.get("grad_reduce", "per_step"))


def insert_sharding(actions: Sequence[Action], sharding: Sharding) -> list[Action]:
    """One rank's ``actions`` (any mix of compute, overlaps, sends and receives) with the
    sharding actions ``sharding`` asks for inserted (see the module docstring)."""
    if not sharding.inserts:
        return list(actions)
    gather = sharding.level == 3
    per_step = sharding.grad_reduce == "per_step"
    last_backward: dict[int, int] = {}            # stage -> index of its last backward action
    if per_step:
        for i, a in enumerate(actions):
            for p in a.parts:
                if p.op in _BACKWARD:
                    last_backward[p.stage] = i
    out: list[Action] = []
    after: list[Action] = []          # the last compute's REDUCE_GRAD / RESHARD, behind its sends
    new = tuple.__new__
    for i, a in enumerate(actions):
        parts = a.parts
        if parts[0].op in _SENDS:
            out.append(a)
            continue
        if after:
            out.extend(after)
            after = []
        if parts[0].op not in BASIC_COMPUTE_OPS:          # a receive, or inserted by hand
            out.append(a)
            continue
        if gather:
            for p in _first_per_stage(parts):
                out.append(new(Action, (UNSHARD, p.stage, p.microbatch)))
        out.append(a)
        for p in parts:
            if per_step:
                if p.op in _BACKWARD and last_backward.get(p.stage) == i:
                    after.append(new(Action, (REDUCE_GRAD, p.stage, p.microbatch)))
            elif p.op in _MAKES_WEIGHT_GRADS:
                after.append(new(Action, (REDUCE_GRAD, p.stage, p.microbatch)))
        if gather:
            for p in _first_per_stage(parts):
                after.append(new(Action, (RESHARD, p.stage, p.microbatch)))
    out.extend(after)
    return out


def _first_per_stage(parts: Sequence[Action]) -> list[Action]:
    seen: set[int] = set()
    out = []
    for p in parts:
        if p.stage not in seen:
            seen.add(p.stage)
            out.append(p)
    return out


def check_sharding(actions: Sequence[Action], rank: int) -> str | None:
    """What is wrong with the sharding actions of one rank's list, in words naming the rank
    and the action (None when nothing): every ``RESHARD s`` closes an ``UNSHARD s`` and every
    ``UNSHARD s`` is closed before the step ends; where a stage is ever unsharded, its compute
    runs inside a window; a ``REDUCE_GRAD s`` follows a backward of ``s`` and no backward of
    ``s`` follows the last one (every gradient reduced)."""
    open_: set[int] = set()
    gathered: set[int] = {a.stage for a in actions if a.op == UNSHARD}
    backward_seen: set[int] = set()
    reduced_after: dict[int, bool] = {}            # stage -> reduced since its last backward
    for a in actions:
        op = a.op
        if op == UNSHARD:
            if a.stage in open_:
                return f"rank {rank}: action {a} gathers stage {a.stage}, already whole"
            open_.add(a.stage)
        elif op == RESHARD:
            if a.stage not in open_:
                return (f"rank {rank}: action {a} releases stage {a.stage}, which no UNSHARD "
                        "gathered")
            open_.discard(a.stage)
        elif op == REDUCE_GRAD:
            if a.stage not in backward_seen:
                return (f"rank {rank}: action {a} reduces stage {a.stage}'s gradients before any "
                        "backward of it")
            reduced_after[a.stage] = True
        else:
            for p in a.parts:
                if p.op not in BASIC_COMPUTE_OPS:
                    continue
                if p.stage in gathered and p.stage not in open_:
                    return (f"rank {rank}: action {a} computes stage {p.stage} outside an "
                            f"UNSHARD / RESHARD window (its weights are released)")
                if p.op in _BACKWARD:
                    backward_seen.add(p.stage)
                    if p.stage in reduced_after:
                        reduced_after[p.stage] = False
    if open_:
        s = min(open_)
        return f"rank {rank}: stage {s} is gathered (UNSHARD) and never released (RESHARD)"
    for s, done in sorted(reduced_after.items()):
        if not done:
            return (f"rank {rank}: stage {s} has a backward after its last REDUCE_GRAD: those "
                    "gradients are never reduced")
    return None


__all__ = ["GRAD_REDUCE", "SHARD_OPS", "Sharding", "check_sharding", "insert_sharding"]
