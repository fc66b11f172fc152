"""Prove a schedule sound without running it.

Three passes, cheapest first, each raising :class:`ScheduleError` with the rank, action and
reason:

1. *well-formed*: every action's stage is on the rank whose list holds it, and its microbatch is
   in range;
2. *complete*: per (stage, microbatch) exactly one F and either one B or one I and one W (only F
   when forward-only); on each rank F before B/I and I before W; every send matched by exactly one
   receive of the same tensor on the peer rank;
3. *deadlock-free*: symbolic execution with asynchronous sends and blocking receives. A compute
   action waits for its inputs (the previous stage's F, the next stage's B/I, locally or through a
   receive). If no rank can move, every stuck rank is named with the action it waits on.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from ..errors import ScheduleError
from .action import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action
from .comms import peer_stage

if TYPE_CHECKING:
    from .schedule import Schedule


def validate_schedule(schedule: "Schedule") -> None:
    computes = [schedule.compute_order(r) for r in range(schedule.pp)]
    _check_well_formed(schedule, computes)
    lists = [schedule.actions(r) for r in range(schedule.pp)]
    if schedule.has_explicit_comms:
        _check_well_formed(schedule, lists)
    _check_complete(schedule)
    _check_comm_matching(schedule, lists)
    _check_no_deadlock(schedule, lists)


def _check_well_formed(schedule: "Schedule", lists: list[list[Action]]) -> None:
    m, n = schedule.num_microbatches, schedule.num_stages
    placement = schedule.placement
    for rank, actions in enumerate(lists):
        for a in actions:
            if not 0 <= a.stage < n:
                raise ScheduleError(f"rank {rank}: action {a} names stage {a.stage}, outside 0..{n - 1}")
            if not 0 <= a.microbatch < m:
                raise ScheduleError(
                    f"rank {rank}: action {a} names microbatch {a.microbatch}, outside 0..{m - 1}")
            if placement[a.stage] != rank:
                raise ScheduleError(
                    f"rank {rank}: action {a} runs stage {a.stage}, which the placement puts on "
                    f"rank {placement[a.stage]}")
            if schedule.forward_only and a.op not in (F, SEND_F, RECV_F):
                raise ScheduleError(f"rank {rank}: action {a} is a backward action in a forward-only schedule")
            if a.op in (SEND_F, RECV_B) and a.stage == n - 1 or a.op in (RECV_F, SEND_B) and a.stage == 0:
                raise ScheduleError(f"rank {rank}: action {a} has no peer stage {peer_stage(a)}")


def _check_complete(schedule: "Schedule") -> None:
    seen: dict[tuple[str, int, int], int] = {}
    for rank in range(schedule.pp):
        pos: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(schedule.compute_order(rank)):
            if a in pos:
                raise ScheduleError(f"rank {rank}: action {a} appears twice")
            pos[a] = i
            op, s, mb = a
            if op in (B, I) and (F, s, mb) not in pos:
                raise ScheduleError(f"rank {rank}: action {a} comes before its forward {s}F{mb}")
            if op == W and (I, s, mb) not in pos:
                raise ScheduleError(f"rank {rank}: action {a} comes before its input-gradient {s}I{mb}")
            if op in (I, W) and (B, s, mb) in pos or op == B and ((I, s, mb) in pos or (W, s, mb) in pos):
                raise ScheduleError(f"rank {rank}: action {a}: stage {s} microbatch {mb} has both "
                                    "a full backward B and a split backward I/W")
            seen[a] = rank
    for s in range(schedule.num_stages):
        rank = schedule.placement[s]
        for mb in range(schedule.num_microbatches):
            if (F, s, mb) not in seen:
                raise ScheduleError(f"rank {rank}: forward {s}F{mb} is missing")
            if schedule.forward_only:
                continue
            has_b, has_i, has_w = (B, s, mb) in seen, (I, s, mb) in seen, (W, s, mb) in seen
            if not (has_b or has_i):
                raise ScheduleError(f"rank {rank}: backward {s}B{mb} (or {s}I{mb} + {s}W{mb}) is missing")
            if has_i and not has_w:
                raise ScheduleError(f"rank {rank}: weight-gradient {s}W{mb} is missing after {s}I{mb}")


def _check_comm_matching(schedule: "Schedule", lists: list[list[Action]]) -> None:
    placement = schedule.placement
    sends: dict[tuple[str, int, int], int] = {}
    recvs: dict[tuple[str, int, int], int] = {}
    # A tensor is named by (direction, receiving stage, microbatch).
    for rank, actions in enumerate(lists):
        for a in actions:
            op = a.op
            if op in (SEND_F, SEND_B):
                table, key = sends, (op[-1], peer_stage(a), a.microbatch)
            elif op in (RECV_F, RECV_B):
                table, key = recvs, (op[-1], a.stage, a.microbatch)
            else:
                continue
            if key in table:
                raise ScheduleError(f"rank {rank}: action {a} is a duplicate of an earlier {op}")
            if placement[peer_stage(a)] == rank:
                raise ScheduleError(f"rank {rank}: action {a} communicates with stage {peer_stage(a)} "
                                    "on the same rank; same-rank stages exchange nothing")
            table[key] = rank
    for key, rank in sends.items():
        if key not in recvs:
            d, s, mb = key
            src = s - 1 if d == "F" else s + 1
            raise ScheduleError(
                f"rank {rank}: action {src}SEND_{d}{mb} has no matching {s}RECV_{d}{mb} on rank "
                f"{placement[s]}")
    for key, rank in recvs.items():
        if key not in sends:
            d, s, mb = key
            src = s - 1 if d == "F" else s + 1
            raise ScheduleError(
                f"rank {rank}: action {s}RECV_{d}{mb} has no matching {src}SEND_{d}{mb} on rank "
                f"{placement[src]}")


def _check_no_deadlock(schedule: "Schedule", lists: list[list[Action]]) -> None:
    """Symbolic execution: asynchronous sends, blocking receives, compute waits for its inputs."""
    placement = schedule.placement
    last = schedule.num_stages - 1
    done: set[tuple] = set()          # ("F"|"G", stage, mb) computed; ("m"+dir, stage, mb) delivered
    received: set[tuple] = set()      # (dir, stage, mb) received by the stage's rank
    waiting: dict[tuple, list[int]] = defaultdict(list)
    blocked_on: dict[int, tuple[Action, str]] = {}
    pointer = [0] * schedule.pp
    work = list(range(schedule.pp))

    def need(action: Action) -> tuple[tuple, str] | None:
        """The event ``action`` still waits for, with words for an error; None when ready."""
        op, s, mb = action
        if op == F:
            if s == 0:
                return None
            if placement[s - 1] == placement[s]:
                key = ("F", s - 1, mb)
                return None if key in done else (key, f"the forward {s - 1}F{mb} on this rank")
            key = ("F", s, mb)
            return None if key in received else (("rF", s, mb), f"a receive {s}RECV_F{mb} of its input")
        if op == B or op == I:
            if ("F", s, mb) not in done:
                return ("F", s, mb), f"its forward {s}F{mb}"
            if s == last:
                return None
            if placement[s + 1] == placement[s]:
                key = ("G", s + 1, mb)
                return None if key in done else (key, f"the backward {s + 1}B/I{mb} on this rank")
            key = ("B", s, mb)
            return None if key in received else (("rB", s, mb), f"a receive {s}RECV_B{mb} of its output gradient")
        if op == W:
            key = ("I", s, mb)
            return None if key in done else (key, f"its input-gradient {s}I{mb}")
        if op == SEND_F:
            key = ("F", s, mb)
            return None if key in done else (key, f"the forward {s}F{mb} that produces it")
        if op == SEND_B:
            key = ("G", s, mb)
            return None if key in done else (key, f"the backward {s}B/I{mb} that produces it")
        if op == RECV_F:
            key = ("mF", s, mb)
            return None if key in done else (key, f"{s - 1}SEND_F{mb} from rank {placement[s - 1]}")
        key = ("mB", s, mb)  # RECV_B
        return None if key in done else (key, f"{s + 1}SEND_B{mb} from rank {placement[s + 1]}")

    def finish(key: tuple) -> None:
        done.add(key)
        for r in waiting.pop(key, ()):
            work.append(r)

    while work:
        rank = work.pop()
        actions = lists[rank]
        i = pointer[rank]
        blocked_on.pop(rank, None)
        while i < len(actions):
            a = actions[i]
            wait = need(a)
            if wait is not None:
                waiting[wait[0]].append(rank)
                blocked_on[rank] = (a, wait[1])
                break
            op, s, mb = a
            if op == F:
                finish(("F", s, mb))
            elif op == B:
                finish(("G", s, mb))
            elif op == I:
                finish(("G", s, mb))
                finish(("I", s, mb))
            elif op == SEND_F:
                finish(("mF", s + 1, mb))
            elif op == SEND_B:
                finish(("mB", s - 1, mb))
            elif op == RECV_F:
                received.add(("F", s, mb))
                finish(("rF", s, mb))
            elif op == RECV_B:
                received.add(("B", s, mb))
                finish(("rB", s, mb))
            i += 1
        pointer[rank] = i

    if blocked_on:
        stuck = "; ".join(f"rank {r} is stuck at {a} waiting for {why}"
                          for r, (a, why) in sorted(blocked_on.items()))
        raise ScheduleError(f"deadlock: {stuck}")
