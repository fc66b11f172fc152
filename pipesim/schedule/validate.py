"""Prove a schedule sound without running it.

Three passes, cheapest first (an overlapped ``OVERLAP_F_B`` counts as its parts), each raising :class:`ScheduleError` with the rank, action and
reason:

1. *well-formed*: every action's stage is on the rank whose list holds it, its microbatch is
   in range and the stage is on that microbatch's route (``Schedule.route``);
2. *complete*: per (stage, microbatch) of each route exactly one F and either one B or one I and one W (only F
   when forward-only); on each rank F before B/I and I before W; every send matched by exactly one
   receive of the same tensor on the peer rank; the backward part of an overlap does not need
   its forward part (so a device may run them at once);
3. *deadlock-free*: symbolic execution with asynchronous sends and blocking receives. A compute
   action waits for its inputs (the previous stage's F, the next stage's B/I, locally or through a
   receive). If no rank can move, every stuck rank is named with the action it waits on.

A RECV only posts a receive; the computation that needs the tensor waits (the executor and the
simulator both do this). Inserted receives are checked that way, through the compute orders.
Hand-written lists are checked with each RECV blocking where it stands, which is stricter: a
schedule that completes so also completes when the waits happen later.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ScheduleError
from .action import B, F, I, OVERLAP_F_B, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, flat_parts
from .comms import peer_stage

if TYPE_CHECKING:
    from .schedule import Schedule


def validate_schedule(schedule: "Schedule") -> None:
    overlaps = schedule.has_overlaps
    computes = [schedule.compute_order(r) for r in range(schedule.pp)]
    if overlaps:
        computes = [_gated(order) for order in computes]
    _check_well_formed(schedule, computes)
    _check_complete(schedule)
    if overlaps:
        _check_overlaps(schedule)
    if schedule.has_explicit_comms:
        # Hand-written communication is checked; inserted communication matches by construction
        # (insert_comms emits a send and its receive under the same condition).
        lists = [schedule.actions(r) for r in range(schedule.pp)]
        if overlaps:
            lists = [_gated(order) for order in lists]
        _check_well_formed(schedule, lists)
        _check_comm_matching(schedule, lists)
        _check_no_deadlock(schedule, lists)
        return
    # Inserted sends sit right after their producer and receives only post (the consumer
    # waits), so running the compute orders with direct cross-rank dependencies is exact and
    # 3x shorter. Only a failure replays the full lists, to name the receive each rank is stuck at.
    try:
        _check_no_deadlock(schedule, computes, direct=True)
    except ScheduleError:
        lists = [schedule.actions(r) for r in range(schedule.pp)]
        _check_no_deadlock(schedule, [_gated(order) for order in lists] if overlaps else lists)
        raise


def _gated(actions: list[Action]) -> list[Action]:
    """Each overlap followed by its parts: the passes below check the parts, and the deadlock
    pass reads the overlap itself as a gate that waits for its backward part's inputs, so the
    parts start together once both have their inputs."""
    out: list[Action] = []
    for a in actions:
        out.append(a)
        if a.op == OVERLAP_F_B:
            out.extend(a.parts)
    return out


def _check_overlaps(schedule: "Schedule") -> None:
    """The backward part of an overlap must not need its forward part.

    B or I of (stage s, microbatch k) needs the output gradient of stage s, which comes back
    from the loss through every later stage's forward of k: so a forward of k on a stage >= s
    in the same overlap would have to finish before its own backward could start.
    """
    for rank in range(schedule.pp):
        for a in schedule.compute_order(rank):
            if a.op != OVERLAP_F_B:
                continue
            fwd, bwd = a.parts
            if fwd.microbatch == bwd.microbatch and fwd.stage >= bwd.stage:
                raise ScheduleError(
                    f"rank {rank}: action {a}: its backward {bwd} needs its forward {fwd} to have "
                    "run (the gradient comes back through that forward's output); overlapped "
                    "parts must be independent")


def _check_well_formed(schedule: "Schedule", lists: list[list[Action]]) -> None:
    m, n = schedule.num_microbatches, schedule.num_stages
    placement = schedule.placement
    bounds = schedule.route_bounds()
    firsts, lasts = bounds if bounds is not None else ([0] * m, [n - 1] * m)
    for rank, actions in enumerate(lists):
        for a in actions:
            if a.op == OVERLAP_F_B:
                if schedule.forward_only:
                    raise ScheduleError(f"rank {rank}: action {a} overlaps a backward in a "
                                        "forward-only schedule")
                continue                       # its parts follow it (see _gated)
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
            first, last = firsts[a.microbatch], lasts[a.microbatch]
            if not first <= a.stage <= last:
                raise ScheduleError(
                    f"rank {rank}: action {a} runs stage {a.stage}, which is not on microbatch "
                    f"{a.microbatch}'s route (stages {first}..{last})")
            if a.op in (SEND_F, RECV_B) and a.stage == last or a.op in (RECV_F, SEND_B) and a.stage == first:
                where = (f"its route ends at stage {last}" if a.op in (SEND_F, RECV_B)
                         else f"its route starts at stage {first}")
                raise ScheduleError(f"rank {rank}: action {a} has no peer stage {peer_stage(a)} "
                                    f"(microbatch {a.microbatch}: {where})")


def _check_complete(schedule: "Schedule") -> None:
    """Exactly one F, and one B or one I + W, per (stage, microbatch), in order on their rank.

    Flags live in flat arrays indexed by ``stage * m + microbatch``; well-formedness has already
    put every stage on its own rank, so one array per op serves all ranks.
    """
    m = schedule.num_microbatches
    size = schedule.num_stages * m
    seen = {op: bytearray(size) for op in (F, B, I, W)}
    f_seen, b_seen, i_seen, w_seen = seen[F], seen[B], seen[I], seen[W]
    for rank in range(schedule.pp):
        for a in schedule.compute_parts(rank):
            op, s, mb = a
            k = s * m + mb
            flags = seen[op]
            if flags[k]:
                raise ScheduleError(f"rank {rank}: action {a} appears twice")
            flags[k] = 1
            if op == F:
                continue
            if op == W:
                if not i_seen[k]:
                    raise ScheduleError(f"rank {rank}: action {a} comes before its input-gradient {s}I{mb}")
            elif not f_seen[k]:
                raise ScheduleError(f"rank {rank}: action {a} comes before its forward {s}F{mb}")
            if b_seen[k] and (i_seen[k] or w_seen[k]):
                raise ScheduleError(f"rank {rank}: action {a}: stage {s} microbatch {mb} has both "
                                    "a full backward B and a split backward I/W")

    bounds = schedule.route_bounds()
    if bounds is None:
        def missing(flags: bytes, start: int = 0) -> int:
            return flags.find(0, start)
    else:
        # Off-route (stage, microbatch) pairs count as seen: well-formedness refused actions there.
        off = bytearray(size)
        n = schedule.num_stages
        for mb in range(m):
            for s in range(n):
                if not bounds[0][mb] <= s <= bounds[1][mb]:
                    off[s * m + mb] = 1

        def missing(flags: bytes, start: int = 0) -> int:
            return bytes(x | y for x, y in zip(flags, off)).find(0, start)

    k = missing(f_seen)
    if k >= 0:
        s, mb = divmod(k, m)
        raise ScheduleError(f"rank {schedule.placement[s]}: forward {s}F{mb} is missing")
    if schedule.forward_only:
        return
    grad = bytes(x | y for x, y in zip(b_seen, i_seen))
    k = missing(grad)
    if k >= 0:
        s, mb = divmod(k, m)
        raise ScheduleError(
            f"rank {schedule.placement[s]}: backward {s}B{mb} (or {s}I{mb} + {s}W{mb}) is missing")
    if i_seen != w_seen:
        k = next(k for k in range(size) if i_seen[k] and not w_seen[k])
        s, mb = divmod(k, m)
        raise ScheduleError(f"rank {schedule.placement[s]}: weight-gradient {s}W{mb} is missing after {s}I{mb}")


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


def _check_no_deadlock(schedule: "Schedule", lists: list[list[Action]], direct: bool = False) -> None:
    """Symbolic execution: asynchronous sends, blocking receives, compute waits for its inputs.

    Events are flags in flat arrays indexed by ``stage * m + microbatch``; a rank that cannot
    move parks itself on the one event it waits for and is woken when that event happens.
    """
    placement = schedule.placement
    m = schedule.num_microbatches
    last = schedule.num_stages - 1
    size = schedule.num_stages * m
    # Event kinds; a waiting key is kind * size + index.
    K_F, K_G, K_I, K_MF, K_MB, K_RF, K_RB = range(7)
    flags = [bytearray(size) for _ in range(7)]
    f_done, g_done, i_done, msg_f, msg_b, recv_f, recv_b = flags
    # ``direct``: every input dependency is read straight from the producer's flag, as if local.
    prev_local = [s > 0 and (direct or placement[s - 1] == placement[s]) for s in range(last + 1)]
    next_local = [s < last and (direct or placement[s + 1] == placement[s]) for s in range(last + 1)]
    bounds = schedule.route_bounds()
    firsts, lasts = bounds if bounds is not None else ([0] * m, [last] * m)
    waiting: dict[int, list[int]] = {}
    blocked: dict[int, tuple[Action, int, int]] = {}   # rank -> (action, kind, index) waited on
    pointer = [0] * schedule.pp
    work = list(range(schedule.pp))

    def backward_wait(s: int, k: int) -> tuple[int, int] | None:
        """The event a backward of stage ``s`` (index ``k``) still waits for: its forward, then
        the gradient of its output (from the local next stage, or received); None if neither."""
        if not f_done[k]:
            return K_F, k
        if s < lasts[k % m]:
            if next_local[s]:
                if not g_done[k + m]:
                    return K_G, k + m
            elif not recv_b[k]:
                return K_RB, k
        return None

    while work:
        rank = work.pop()
        blocked.pop(rank, None)
        actions = lists[rank]
        n = len(actions)
        i = pointer[rank]
        while i < n:
            a = actions[i]
            op, s, mb = a
            k = s * m + mb
            wait = -1
            if op == F:
                if s > firsts[mb]:
                    if prev_local[s]:
                        if not f_done[k - m]:
                            wait, widx = K_F, k - m
                    elif not recv_f[k]:
                        wait, widx = K_RF, k
                if wait < 0:
                    f_done[k] = 1
                    key = K_F * size + k
            elif op == B or op == I:
                need = backward_wait(s, k)
                if need is not None:
                    wait, widx = need
                else:
                    g_done[k] = 1
                    key = K_G * size + k
                    if op == I:
                        i_done[k] = 1
                        if waiting:
                            woken = waiting.pop(K_I * size + k, None)
                            if woken:
                                work.extend(woken)
            elif op == W:
                if not i_done[k]:
                    wait, widx = K_I, k
                key = -1
            elif op == OVERLAP_F_B:
                # The gate before an overlap's parts: its backward part's inputs must be there
                # too before the forward part starts.
                s, mb = a.parts[1].stage, a.parts[1].microbatch
                need = backward_wait(s, s * m + mb)
                if need is not None:
                    wait, widx = need
                key = -1
            elif op == SEND_F:
                if not f_done[k]:
                    wait, widx = K_F, k
                else:
                    msg_f[k + m] = 1
                    key = K_MF * size + k + m
            elif op == SEND_B:
                if not g_done[k]:
                    wait, widx = K_G, k
                else:
                    msg_b[k - m] = 1
                    key = K_MB * size + k - m
            elif op == RECV_F:
                if not msg_f[k]:
                    wait, widx = K_MF, k
                else:
                    recv_f[k] = 1
                    key = K_RF * size + k
            else:  # RECV_B
                if not msg_b[k]:
                    wait, widx = K_MB, k
                else:
                    recv_b[k] = 1
                    key = K_RB * size + k
            if wait >= 0:
                waiting.setdefault(wait * size + widx, []).append(rank)
                blocked[rank] = (a, wait, widx)
                break
            if waiting and key >= 0:
                woken = waiting.pop(key, None)
                if woken:
                    work.extend(woken)
            i += 1
        pointer[rank] = i

    if blocked:
        stuck = "; ".join(f"rank {r} is stuck at {a} waiting for {_waited_for(a, kind, idx, m, placement)}"
                          for r, (a, kind, idx) in sorted(blocked.items()))
        raise ScheduleError(f"deadlock: {stuck}")


def _waited_for(action: Action, kind: int, index: int, m: int, placement: tuple[int, ...]) -> str:
    """Words for the event a stuck action waits on (kinds as in _check_no_deadlock)."""
    s, mb = divmod(index, m)
    here = "on this rank"
    if kind == 0:
        return (f"its forward {s}F{mb}" if s == action.stage and action.op != F
                else f"the forward {s}F{mb} {here}")
    if kind == 1:
        return (f"the backward {s}B/I{mb} that produces it" if action.op == SEND_B
                else f"the backward {s}B/I{mb} {here}")
    if kind == 2:
        return f"its input-gradient {s}I{mb}"
    if kind == 3:
        return f"{s - 1}SEND_F{mb} from rank {placement[s - 1]}"
    if kind == 4:
        return f"{s + 1}SEND_B{mb} from rank {placement[s + 1]}"
    if kind == 5:
        return f"a receive {s}RECV_F{mb} of its input"
    return f"a receive {s}RECV_B{mb} of its output gradient"
