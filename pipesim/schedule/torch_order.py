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
says where a list of actions breaks the order: the FIFO model of :mod:`.channels` with one FIFO
per direction between two ranks (`torch_channel`).
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from .action import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, Action
from .channels import ChannelError, Transfer, check_channels

if TYPE_CHECKING:
    from .schedule import Schedule


def torch_channel(t: Transfer) -> Hashable:
    """torch's runtime on one untagged group: the messages from one rank to another match in
    posting order, activations and gradients alike (each direction its own FIFO)."""
    return (t.src, t.dst)


def check_single_channel(schedule: "Schedule", lists: list[list[Action]] | None = None) -> None:
    """Raise `ChannelError` (a ScheduleError) where some rank posts its receives from a peer in
    another order than the peer posts the sends, or the transfers, so matched, never complete
    (``lists``: per-rank actions; default ``schedule.actions``): `check_channels` over
    `torch_channel`."""
    if lists is not None:
        # the lists carry their receives: a lookahead (where inserted receives go) has no say
        schedule = schedule.with_orders(lists, recv_lookahead=0)
    try:
        check_channels(schedule, torch_channel)
    except ChannelError as exc:
        raise ChannelError(
            f"{exc}; torch.distributed.pipelining matches untagged messages so too, and would "
            "pair the wrong tensors or wait forever (export with "
            "schedule_to_csv(..., with_comms=True), which orders the receives for it)",
            exc.rank, exc.action, exc.peer, exc.kind) from None


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
