"""Channels as NCCL has them: which FIFO each transfer is posted on, and whether a schedule's
transfers, posted in order on those FIFOs, match and complete.

NCCL ignores tags. Between two ranks, the transfers posted on one communicator match in the order
they are posted (the i-th send from ``a`` to ``b`` with the i-th receive at ``b`` from ``a``), and
each rank runs a communicator's operations on one stream, in order: an operation starts only
when every earlier one of that communicator on that rank has completed (head-of-line blocking),
and a send completes only together with its matching receive (rendezvous). A *channel function*
says which communicator (FIFO) a transfer is posted on; `check_channels` runs a schedule's
actions over those FIFOs and raises `ChannelError` naming rank, action and peer at the first
transfer that would receive another one's data (a mismatch: same shape, silently wrong numbers)
or when no rank can move (a deadlock).

The host model is the executor's (`pipeexec.pipeline.runtime`): a rank walks its action list; SEND / RECV
only post (never block); a compute waits for the receive of its input; the end of a step waits
for every transfer of the step. ``defer_first_activation`` adds pipeexec's rule for a stage
boundary's first activation, whose shape is not known before its header arrives: in the first
step it is posted only when its consumer waits for it (the host then blocks until it has
arrived), and every later receive on its channel ``(kind, src, dst)`` is deferred behind it, in
order. Waiting on the device instead (stream waits) gives the same dependencies: a transfer on
the communicator's stream waits for the computations enqueued before it, a computation for the
receives it waits on, so the same schedules complete.

``lazy_communicators`` models torch 2.6-2.7 without eager init (a communicator created at its
first transfer, blocking the host until the peer arrives there too): pipeexec's layout then
deadlocks e.g. gpipe pp 4 m 4 lookahead 1 in the first step, which is why pipeexec creates
and warms up every channel, in one global order, before the first step.

Collectives (``collective_of``): a computation that runs a collective over its tensor- or
data-parallel group (tp's all-reduces inside F and B, ZeRO-3's gathers) posts it on the FIFO
``collective_of(action)`` names and waits for it. Every member of such a group runs this rank's
own program (the same pipeline rank of another tp or dp position), so a collective completes as
soon as it reaches the head of its FIFO; on a communicator of its own it always does, but on a
communicator it shares with p2p transfers (one process group for everything) it waits behind
the transfers posted before it, and e.g. 1F1B deadlocks: a rank's all-reduce behind its early
receive of the next activation, whose sender's all-reduce is behind its receive of this rank's
gradient.

Channel functions provided (any callable ``Transfer -> hashable`` works):

* `one_way_pairs`: one communicator per (kind, src, dst), pipeexec's layout. Each stream carries
  one kind, one way, between two ranks; a schedule whose sender and receiver orders agree on
  every channel (validated schedules from every builder do) cannot deadlock on it beyond what
  `Schedule.validate` already excludes: the receive at the head of a FIFO is matched as soon as
  its sender has posted the send, and nothing else sits in front of it.
* `kind_and_direction`: one communicator per (kind, towards a higher or lower rank) over the
  whole pipeline: "receive from i-1" and "send to i+1" share a stream (torch >= 2.8 with
  ``device_id``: every unbatched isend / irecv of a group runs on that group's communicator).
* `single_group`: every transfer on one communicator (one untagged process group for the
  pipeline, as torch.distributed.pipelining uses).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ScheduleError
from .action import F, RECV_F, SEND_B, SEND_F, Action
from .comms import peer_stage
from .program import FORWARD, Row, lower

if TYPE_CHECKING:
    from .schedule import Schedule


class Transfer(NamedTuple):
    """One tensor crossing a stage boundary: ``kind`` "F" (activation of stage ``boundary``) or
    "B" (gradient of stage ``boundary``'s output), from pipeline rank ``src`` to ``dst``."""

    kind: str
    src: int
    dst: int
    boundary: int
    microbatch: int

    def __str__(self) -> str:
        what = "activation" if self.kind == "F" else "gradient"
        return (f"{what} of stage {self.boundary} microbatch {self.microbatch} "
                f"(rank {self.src} -> {self.dst})")


ChannelFn = Callable[[Transfer], Hashable]


def one_way_pairs(t: Transfer) -> Hashable:
    """pipeexec's layout: one communicator per (kind, src, dst)."""
    return (t.kind, t.src, t.dst)


def kind_and_direction(t: Transfer) -> Hashable:
    """One communicator per (kind, towards a higher or lower rank) over the whole pipeline."""
    return (t.kind, t.dst > t.src)


def single_group(t: Transfer) -> Hashable:
    """One communicator for every transfer of the pipeline."""
    return 0


CollectiveFn = Callable[[Action], "Hashable | None"]


def group_collectives(action: Action) -> Hashable | None:
    """pipeexec's layout with tp > 1 (or ZeRO-2/3): every computation's collectives on the
    group's own communicator, apart from every p2p channel."""
    return ("group",) if action.is_compute else None


class ChannelError(ScheduleError):
    """Transfers that would match the wrong tensor, or never complete, on their FIFOs."""

    def __init__(self, message: str, rank: int, action: Action, peer: int, kind: str) -> None:
        super().__init__(message)
        self.rank, self.action, self.peer, self.kind = rank, action, peer, kind


def _transfer(t) -> Transfer:
    """A lowered program's transfer as this module names it."""
    return Transfer("F" if t.direction == FORWARD else "B", t.src, t.dst, t.boundary,
                    t.microbatch)


def transfer_of(schedule: "Schedule", rank: int, action: Action) -> Transfer:
    """The transfer a SEND_* / RECV_* action of ``rank`` posts."""
    other = peer_stage(action)
    peer = schedule.stage_rank(other)
    kind = "F" if action.op in (SEND_F, RECV_F) else "B"
    src, dst = (rank, peer) if action.op in (SEND_F, SEND_B) else (peer, rank)
    return Transfer(kind, src, dst, min(action.stage, other), action.microbatch)


class _Op:
    __slots__ = ("rank", "action", "transfer", "fifo", "is_send", "peer", "done", "step")

    def __init__(self, rank: int, action: Action, transfer: Transfer, fifo: Hashable,
                 step: int) -> None:
        self.rank, self.action, self.transfer, self.fifo = rank, action, transfer, fifo
        self.is_send = action.op in (SEND_F, SEND_B)
        self.peer = transfer.dst if self.is_send else transfer.src
        self.done = False
        self.step = step

    def __str__(self) -> str:
        return f"{self.action} ({'send to' if self.is_send else 'receive from'} rank {self.peer})"


class _Collective:
    """A computation's collective over its group: complete once at the head of its FIFO."""

    __slots__ = ("rank", "action", "transfer", "fifo", "is_send", "peer", "done", "step")

    def __init__(self, rank: int, action: Action, fifo: Hashable, step: int) -> None:
        self.rank, self.action, self.fifo, self.step = rank, action, fifo, step
        self.transfer, self.is_send, self.peer, self.done = None, False, rank, False

    def __str__(self) -> str:
        return f"{self.action}'s collective over its group"


def check_channels(schedule: "Schedule", channel_of: ChannelFn = one_way_pairs, *,
                   steps: int = 2, defer_first_activation: bool = False,
                   lazy_communicators: bool = False,
                   collective_of: CollectiveFn | None = None) -> None:
    """Run ``steps`` steps of ``schedule`` with every transfer posted on the FIFO
    ``channel_of(transfer)`` names, matched NCCL's way; raise `ChannelError` at the first
    mismatch or deadlock. See the module docstring for the model.

    ``lazy_communicators``: torch 2.6-2.7's NCCL behaviour without eager init: the first
    transfer a rank posts on a (channel, pair of ranks) creates its communicator, and the host
    blocks until the other rank of the pair arrives at its own first transfer there (what
    pipeexec's start-up warm-up, done in one global order, takes out of the steps).

    ``collective_of``: the FIFO of each computation's collectives (None: it has none); see the
    module docstring."""
    pp = schedule.pp
    # The lowered rows, each OVERLAP_F_B as its parts in turn, each waiting for its own input
    # (pipeexec, torch): the transfer a comm row posts, and the receive a computation waits on.
    program = lower(schedule)
    programs = program.in_turn
    transfers = [[_transfer(program.transfers[r[7]]) if r[7] >= 0 else None   # r[7]: message
                  for r in map(Row._make, rows)] for rows in programs]
    need_of = [[r.wait_row - first if r.wait_row >= 0 else -1 for r in map(Row._make, rows)]
               for rows, first in zip(programs, program.first_row)]
    ops: list[list[list[_Op | None]]] = []       # [step][rank][index in the rank's rows]
    for step in range(steps):
        ops.append([[_Op(r, Row(*row).action, t, channel_of(t), step) if t is not None else None
                     for row, t in zip(programs[r], transfers[r])] for r in range(pp)])

    fifos: dict[tuple[int, Hashable], deque[_Op]] = {}
    deferred: dict[tuple[int, tuple], deque[_Op]] = {}   # (rank, (kind, src, dst)) -> receives
    known: list[set[int]] = [set() for _ in range(pp)]   # boundaries whose shape a rank knows
    pc = [(0, 0)] * pp                                   # (step, index) of each host
    blocked: list[_Op | None] = [None] * pp              # what a host waits for
    micro: list[deque] = [deque() for _ in range(pp)]    # flush work queued by a wait
    arrived: dict[tuple, set[int]] = {}                  # lazy communicators: who has come
    created: set[tuple] = set()
    collected = [(-1, -1)] * pp                          # the computation whose collective is done
    row_action = [[Row(*row).action for row in rows] for rows in programs] if collective_of else None

    def post(op: _Op) -> None:
        fifos.setdefault((op.rank, op.fifo), deque()).append(op)

    def must_create(r: int, op: _Op) -> bool:
        """Lazy mode: register ``r`` at ``op``'s communicator; True if ``r`` must wait there."""
        if not lazy_communicators:
            return False
        comm = (op.fifo, min(op.rank, op.peer), max(op.rank, op.peer))
        if comm in created:
            return False
        arrived.setdefault(comm, set()).add(r)
        if len(arrived[comm]) == 2:
            created.add(comm)
            return False
        blocked[r] = _Creation(comm, op)
        return True

    def try_advance(r: int) -> bool:
        moved = False
        while True:
            if blocked[r] is not None:
                b = blocked[r]
                if not (b.comm in created if isinstance(b, _Creation) else b.done):
                    return moved
                blocked[r] = None
                moved = True
            if micro[r]:
                if must_create(r, micro[r][0]):
                    return moved
                op = micro[r].popleft()
                post(op)
                moved = True
                if op.transfer.kind == "F" and op.transfer.boundary not in known[r]:
                    known[r].add(op.transfer.boundary)
                    blocked[r] = op              # the host reads the header before going on
                continue
            step, i = pc[r]
            if step == steps:
                return moved
            if i == len(programs[r]):            # end of step: every transfer completes
                waiting = next((op for op in ops[step][r] if op is not None and not op.done),
                               None)
                if waiting is not None:
                    blocked[r] = waiting
                    continue
                pc[r] = (step + 1, 0)
                moved = True
                continue
            op = ops[step][r][i]
            if op is not None:
                t = op.transfer
                queue = deferred.setdefault((r, (t.kind, t.src, t.dst)), deque())
                if not op.is_send and defer_first_activation and (
                        queue or (t.kind == "F" and t.boundary not in known[r])):
                    queue.append(op)
                elif must_create(r, op):
                    return moved
                else:
                    post(op)
                pc[r] = (step, i + 1)
                moved = True
                continue
            j = need_of[r][i]
            need = ops[step][r][j] if j >= 0 else None
            if need is not None and not need.done:
                queue = deferred.get((r, (need.transfer.kind, need.transfer.src,
                                          need.transfer.dst)))
                if queue and any(q is need for q in queue):
                    while True:
                        q = queue.popleft()
                        micro[r].append(q)
                        if q is need:
                            break
                    continue
                blocked[r] = need
                return moved
            if collective_of is not None and collected[r] != (step, i):
                fifo = collective_of(row_action[r][i])
                collected[r] = (step, i)
                if fifo is not None:
                    coll = _Collective(r, row_action[r][i], fifo, step)
                    post(coll)
                    blocked[r] = coll
                    moved = True
                    continue
            pc[r] = (step, i + 1)
            moved = True

    def match() -> bool:
        moved = False
        for (r, key), fifo in list(fifos.items()):
            while fifo and isinstance(fifo[0], _Collective):
                fifo.popleft().done = True
                moved = True
            if not fifo or not fifo[0].is_send:
                continue
            send = fifo[0]
            other = fifos.get((send.peer, key))
            if not other or other[0].is_send or other[0].peer != r:
                continue
            recv = other[0]
            if recv.transfer != send.transfer:
                raise ChannelError(
                    f"schedule {schedule.name!r} step {recv.step}: rank {recv.rank}'s "
                    f"{recv.action} (receive of the {recv.transfer}) would match rank {r}'s "
                    f"{send.action} (the {send.transfer}) on channel {key!r}: transfers between "
                    "two ranks match in posting order, so the tensor lands in the wrong buffer",
                    recv.rank, recv.action, r, "mismatch")
            fifo.popleft()
            other.popleft()
            send.done = recv.done = True
            moved = True
        return moved

    while True:
        moved = False
        for r in range(pp):
            moved |= try_advance(r)
        moved |= match()
        if all(pc[r][0] == steps and blocked[r] is None and not micro[r] for r in range(pp)):
            return
        if not moved:
            raise _deadlock(schedule, blocked, fifos, pc)


class _Creation(NamedTuple):
    """A host blocked creating a communicator lazily, at its first transfer ``op`` there."""

    comm: tuple
    op: _Op


def _deadlock(schedule: "Schedule", blocked: list, fifos: dict, pc: list) -> ChannelError:
    lines = []
    first = None
    for r, need in enumerate(blocked):
        if need is None:
            continue
        if isinstance(need, _Creation):
            op = need.op
            lines.append(f"rank {r} (step {pc[r][0]}) creates the communicator of channel "
                         f"{op.fifo!r} at its first transfer there, {op}, and waits for rank "
                         f"{op.peer} to arrive")
            if first is None:
                first = (r, op)
            continue
        fifo = fifos.get((r, need.fifo))
        head = fifo[0] if fifo else None
        if head is None or not any(op is need for op in fifo):
            where = "not posted"
        elif isinstance(need, _Collective):
            where = f"behind {head} on channel {need.fifo!r}, which it shares with p2p"
        elif head is need:
            peer_fifo = fifos.get((need.peer, need.fifo))
            where = (f"at the head of channel {need.fifo!r}, where rank {need.peer} has "
                     + (f"{peer_fifo[0]} first" if peer_fifo else "nothing posted"))
        else:
            where = f"behind {head} on channel {need.fifo!r}"
        lines.append(f"rank {r} (step {pc[r][0]}) waits for {need}, {where}")
        if first is None:
            first = (r, need)
    if first is None:
        return ChannelError(f"schedule {schedule.name!r}: no rank can move", -1,
                            Action(F, 0, 0), -1, "deadlock")
    r, need = first
    return ChannelError(f"schedule {schedule.name!r}: deadlock on the channels: "
                        + "; ".join(lines), r, need.action, need.peer, "deadlock")


__all__ = ["Transfer", "ChannelError", "ChannelFn", "CollectiveFn", "check_channels",
           "transfer_of", "one_way_pairs", "kind_and_direction", "single_group",
           "group_collectives"]
