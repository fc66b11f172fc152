"""One channel per pair of ranks: the order torch.distributed.pipelining's runtime needs.

torch's ``_PipelineScheduleRuntime`` sends every point-to-point message untagged over one
process group, so the transfers between two ranks are matched in posting order, activations and
gradients alike: rank b must post its receives from rank a in the order rank a posts its sends
to b. pipeexec does not need this (it tags four channels: activation / gradient, up / down),
and pipesim's inserted receives (right before their consumer) do not always give it: in the V
placement one rank sends both activations and gradients to the same peer, and the receiver
consumes them in another order (ZB-V at pp = 2 parts at the second transfer). torch then runs
without an error and pairs the wrong tensors.

:func:`single_channel_actions` places the receives so that the order holds: sends stay right
after their producers; on each rank, the receives from one peer are posted in that peer's send
order, each as late as that order allows (before its own consumer, and before the consumer of
every later transfer from that peer). A receive only moves earlier, never below its consumer,
and never above what it needs (a gradient's receive comes after the forward whose output it
matches: in any valid run the peer sends it only after that forward). :func:`check_single_channel`
says where a list of actions breaks the order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ScheduleError
from .action import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, Action
from .comms import peer_stage

if TYPE_CHECKING:
    from .schedule import Schedule


def _transfers(schedule: "Schedule", rank: int, lists: list[list[Action]]):
    """Per peer, the transfers rank sends ("out") and receives ("in"), in list order, each named
    by (direction, receiving stage, microbatch)."""
    out: dict[int, list[tuple]] = {}
    inn: dict[int, list[tuple]] = {}
    for a in lists[rank]:
        if a.op in (SEND_F, SEND_B):
            peer = schedule.stage_rank(peer_stage(a))
            out.setdefault(peer, []).append((a.op[-1], peer_stage(a), a.microbatch))
        elif a.op in (RECV_F, RECV_B):
            peer = schedule.stage_rank(peer_stage(a))
            inn.setdefault(peer, []).append((a.op[-1], a.stage, a.microbatch))
    return out, inn


def check_single_channel(schedule: "Schedule", lists: list[list[Action]] | None = None) -> None:
    """Raise ScheduleError where some rank posts its receives from a peer in another order than
    the peer posts the sends (``lists``: per-rank actions; default ``schedule.actions``)."""
    lists = lists if lists is not None else [schedule.actions(r) for r in range(schedule.pp)]
    sent = [_transfers(schedule, r, lists)[0] for r in range(schedule.pp)]
    for b in range(schedule.pp):
        _, inn = _transfers(schedule, b, lists)
        for a in sorted(set(inn) | {p for p in range(schedule.pp) if b in sent[p]}):
            theirs, mine = sent[a].get(b, []), inn.get(a, [])
            for k, (x, y) in enumerate(zip(theirs, mine)):
                if x != y:
                    raise ScheduleError(
                        f"rank {a} -> rank {b}: transfer {k + 1} is {_name(x)} on the sender but "
                        f"{_name(y)} on the receiver; torch.distributed.pipelining matches untagged "
                        "messages between two ranks in posting order and would pair the wrong "
                        "tensors (export with schedule_to_csv(..., with_comms=True), which orders "
                        "the receives for it)")
            if len(theirs) != len(mine):
                raise ScheduleError(f"rank {a} sends {len(theirs)} transfers to rank {b}, which "
                                    f"posts {len(mine)} receives from it")


def _name(t: tuple) -> str:
    d, s, mb = t
    return f"{'activation' if d == 'F' else 'gradient'} {s - 1 if d == 'F' else s + 1}->{s} of microbatch {mb}"


def single_channel_actions(schedule: "Schedule") -> list[list[Action]]:
    """Per rank, the compute order with sends right after their producers and receives posted
    in each peer's send order (see the module docstring). Hand-placed communication is
    returned as it is after checking it (ScheduleError when it breaks the order)."""
    schedule.validate()
    pp = schedule.pp
    first_of, last_of = schedule.first_stage, schedule.last_stage
    if schedule.has_explicit_comms:
        lists = [schedule.actions(r) for r in range(pp)]
        check_single_channel(schedule, lists)
        return lists
    place = schedule.placement
    computes = [schedule.compute_order(r) for r in range(pp)]
    # Sends: right after the producing action, in its parts' order.
    with_sends: list[list[Action]] = []
    send_order: list[dict[int, list[tuple]]] = []
    for r, order in enumerate(computes):
        out: list[Action] = []
        sent: dict[int, list[tuple]] = {}
        for a in order:
            out.append(a)
            for op, s, mb in a.parts:
                if op == F and s < last_of(mb) and place[s + 1] != r:
                    out.append(Action(SEND_F, s, mb))
                    sent.setdefault(place[s + 1], []).append((RECV_F, s + 1, mb))
                elif op in (B, I) and s > first_of(mb) and place[s - 1] != r:
                    out.append(Action(SEND_B, s, mb))
                    sent.setdefault(place[s - 1], []).append((RECV_B, s - 1, mb))
        with_sends.append(out)
        send_order.append(sent)
    lists = []
    for b, order in enumerate(computes):
        consumer: dict[tuple, int] = {}          # (RECV op, stage, mb) -> compute index on b
        for k, a in enumerate(order):
            for op, s, mb in a.parts:
                if op == F:
                    consumer[(RECV_F, s, mb)] = k
                elif op in (B, I):
                    consumer[(RECV_B, s, mb)] = k
        posts: list[list[Action]] = [[] for _ in order]
        for a in range(pp):
            transfers = send_order[a].get(b, [])
            at = len(order)
            placed = []
            for key in reversed(transfers):      # suffix minimum of the consumers
                at = min(at, consumer[key])
                placed.append((at, key))
            for at, (op, s, mb) in reversed(placed):
                posts[at].append(Action(op, s, mb))
        out = []
        k = 0
        for a in with_sends[b]:
            if a.is_compute:
                out.extend(posts[k])
                k += 1
            out.append(a)
        lists.append(out)
    check_single_channel(schedule, lists)
    return lists
