"""`Op`: every operation a schedule, a trace or a runtime names, defined once.

The members are strings equal to their names (``Op.F == "F"``, hashing alike), so actions
parsed from text and actions built with the members compare equal and key the same dicts; each
has a small integer ``code``, its index here, which the trace's categorical ``op`` column, the
simulator's lowered rows and pipeexec's shared-memory board store. The order is the trace's:
compute, then communication, then the step-tail ops; ``OVERLAP_F_B`` (split into its parts
before anything runs) after them. The data-parallel sharding ops (ZeRO as actions, torch's
``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``, inserted by `pipesim.schedule.sharding`) come
last, appended so that every earlier code keeps its value.
"""
from __future__ import annotations

from enum import Enum


class Op(str, Enum):
    F = "F"                      # forward
    B = "B"                      # full backward (input and weight gradients)
    I = "I"                      # noqa: E741  backward for the input gradient
    W = "W"                      # backward for the weight gradient
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"      # step tail: data-parallel gradient all-reduce
    OPTIMIZER = "OPTIMIZER"      # step tail: the optimizer step
    OVERLAP_F_B = "OVERLAP_F_B"  # a forward and a backward run as one action
    UNSHARD = "UNSHARD"          # ZeRO-3: all-gather a stage's parameters whole
    RESHARD = "RESHARD"          # ZeRO-3: release the gathered parameters (no communication)
    REDUCE_GRAD = "REDUCE_GRAD"  # ZeRO-2/3: reduce-scatter a stage's gradients

    __str__ = str.__str__        # "F", in f-strings and str() alike (as StrEnum, on 3.10 too)
    __format__ = str.__format__

    @property
    def code(self) -> int:
        return _CODE[self]

    @classmethod
    def of_code(cls, code: int) -> "Op":
        return _MEMBERS[code]

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def is_send(self) -> bool:
        return self is Op.SEND_F or self is Op.SEND_B

    @property
    def is_tail(self) -> bool:
        return self is Op.ALLREDUCE or self is Op.OPTIMIZER

    @property
    def is_shard(self) -> bool:
        """UNSHARD, RESHARD or REDUCE_GRAD: data-parallel sharding, on a stage."""
        return self in _SHARD


_MEMBERS = tuple(Op)
_CODE = {op: i for i, op in enumerate(_MEMBERS)}
_COMPUTE = frozenset((Op.F, Op.B, Op.I, Op.W, Op.OVERLAP_F_B))
_COMM = frozenset((Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B))
_SHARD = frozenset((Op.UNSHARD, Op.RESHARD, Op.REDUCE_GRAD))

# The trace's categorical ``op`` column: its categories, in code order (no overlap row exists).
TRACE_OPS = _MEMBERS[:Op.OVERLAP_F_B.code]
# Integer codes for hot loops and arrays.
CODE_F, CODE_B, CODE_I, CODE_W = Op.F.code, Op.B.code, Op.I.code, Op.W.code
CODE_SEND_F, CODE_RECV_F = Op.SEND_F.code, Op.RECV_F.code
CODE_SEND_B, CODE_RECV_B = Op.SEND_B.code, Op.RECV_B.code
CODE_ALLREDUCE, CODE_OPTIMIZER = Op.ALLREDUCE.code, Op.OPTIMIZER.code
FIRST_COMM_CODE = CODE_SEND_F          # compute codes are below it
CODE_UNSHARD, CODE_RESHARD, CODE_REDUCE_GRAD = Op.UNSHARD.code, Op.RESHARD.code, Op.REDUCE_GRAD.code
FIRST_SHARD_CODE = CODE_UNSHARD        # the sharding ops' codes are it and above

__all__ = ["Op", "TRACE_OPS"]
