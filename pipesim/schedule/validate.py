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

from enum import IntEnum

from ..errors import ScheduleError
from .action import (B, F, I, OVERLAP_F_B, RECV_B, RECV_F, SEND_B, SEND_F, SHARD_OPS, W, Action,
                     Overlap)
from .comms import peer_stage
from .grid import format_grid
from .op import (CODE_B, CODE_F, CODE_I, CODE_SEND_B, CODE_SEND_F, CODE_W, FIRST_COMM_CODE,
                 FIRST_SHARD_CODE)
from .program import BACKWARD, FORWARD, Row, lower, message, message_parts

if TYPE_CHECKING:
    from .schedule import Schedule


def validate_schedule(schedule: "Schedule") -> None:
    overlaps = schedule.has_overlaps
    computes = [schedule.compute_order(r) for r in range(schedule.pp)]
    _check_well_formed(schedule, computes)
    _check_complete(schedule)
    if overlaps:
        _check_overlaps(schedule)
    validate_sharding(schedule)
    if schedule.has_explicit_comms:
        # Hand-written communication is checked; inserted communication matches by construction
        # (insert_comms emits a send and its receive under the same condition).
        lists = [schedule.actions(r) for r in range(schedule.pp)]
        _check_well_formed(schedule, lists)
        _check_comm_matching(schedule, lists)
        _check_no_deadlock(schedule)
        return
    # Inserted sends sit right after their producer and receives only post (the consumer
    # waits), so running the compute rows with direct cross-rank dependencies is exact and
    # 3x shorter. Only a failure replays the full rows, to name the receive each rank is stuck at.
    try:
        _check_no_deadlock(schedule, direct=True)
    except ScheduleError:
        _check_no_deadlock(schedule)
        raise


def _fail(schedule: "Schedule", rank: int, action: Action, message: str) -> ScheduleError:
    """A ScheduleError about ``action`` of ``rank``: its step in the rank's list (an overlap's
    part: the overlap's step) and the rank-by-step grid of the action lists, that step marked."""
    try:
        lists = [schedule.actions(r) for r in range(schedule.pp)]
    except (IndexError, ScheduleError):            # stages off the placement: compute orders
        lists = [schedule.compute_order(r) for r in range(schedule.pp)]
    step = _step_of(lists[rank], action)
    grid = format_grid(lists, step, rank) if step is not None else None
    return ScheduleError(message, rank=rank, step=step, action=action, grid=grid)


def _step_of(actions: list[Action], action: Action) -> int | None:
    """Where ``action`` (or the overlap holding it) is in ``actions``."""
    for i, a in enumerate(actions):
        if a == action or (a.op == OVERLAP_F_B and action in a.parts):
            return i
    return None


def validate_sharding(schedule: "Schedule") -> None:
    """The sharding actions (inserted or by hand), if any: on their rank's stages, UNSHARD /
    RESHARD windows closed and around the stage's compute, every gradient reduced
    (:func:`pipesim.schedule.sharding.check_sharding`)."""
    if schedule.sharding is None and not schedule.has_explicit_comms:
        return
    from .sharding import check_sharding

    lists = [schedule.actions(r) for r in range(schedule.pp)]
    if schedule.sharding is None and not any(a.op in SHARD_OPS for acts in lists for a in acts):
        return
    if schedule.forward_only:
        for rank, acts in enumerate(lists):
            for a in acts:
                if a.op == "REDUCE_GRAD":
                    raise _fail(schedule, rank, a, f"rank {rank}: action {a} reduces gradients "
                                "in a forward-only schedule")
    if schedule.has_explicit_comms:
        # by hand: each on its rank's stages, once; inserted ones are by construction (one
        # around or after a computation the compute lists' check already passed)
        _check_well_formed(schedule, lists)
    for rank, acts in enumerate(lists):
        problem = check_sharding(acts, rank)
        if problem is not None:
            raise ScheduleError(problem)


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
                raise _fail(schedule, rank, a,
                    f"rank {rank}: action {a}: its backward {bwd} needs its forward {fwd} to have "
                    "run (the gradient comes back through that forward's output); overlapped "
                    "parts must be independent")


def _check_well_formed(schedule: "Schedule", lists: list[list[Action]]) -> None:
    m, n = schedule.num_microbatches, schedule.num_stages
    placement = schedule.placement
    bounds = schedule.route_bounds()
    firsts, lasts = bounds if bounds is not None else ([0] * m, [n - 1] * m)
    for rank, actions in enumerate(lists):
        for whole in actions:
            if whole.op != OVERLAP_F_B:
                parts = (whole,)
            elif schedule.forward_only:
                raise _fail(schedule, rank, whole, f"rank {rank}: action {whole} overlaps a "
                            "backward in a forward-only schedule")
            else:
                parts = whole.parts                # an overlap: each of its parts
            for a in parts:
                if not 0 <= a.stage < n:
                    raise _fail(schedule, rank, a,
                                f"rank {rank}: action {a} names stage {a.stage}, outside 0..{n - 1}")
                if a.op in SHARD_OPS:
                    if not -1 <= a.microbatch < m:
                        raise _fail(schedule, rank, a, f"rank {rank}: action {a} names microbatch "
                                    f"{a.microbatch}, outside 0..{m - 1}")
                    if placement[a.stage] != rank:
                        raise _fail(schedule, rank, a, f"rank {rank}: action {a} shards stage "
                                    f"{a.stage}, which the placement puts on rank "
                                    f"{placement[a.stage]}")
                    continue
                if not 0 <= a.microbatch < m:
                    raise _fail(
                        schedule, rank, a,
                        f"rank {rank}: action {a} names microbatch {a.microbatch}, outside 0..{m - 1}")
                if placement[a.stage] != rank:
                    raise _fail(
                        schedule, rank, a,
                        f"rank {rank}: action {a} runs stage {a.stage}, which the placement puts on "
                        f"rank {placement[a.stage]}")
                if schedule.forward_only and a.op not in (F, SEND_F, RECV_F):
                    raise _fail(schedule, rank, a, f"rank {rank}: action {a} is a backward action in a "
                                "forward-only schedule")
                first, last = firsts[a.microbatch], lasts[a.microbatch]
                if not first <= a.stage <= last:
                    raise _fail(
                        schedule, rank, a,
                        f"rank {rank}: action {a} runs stage {a.stage}, which is not on microbatch "
                        f"{a.microbatch}'s route (stages {first}..{last})")
                if a.op in (SEND_F, RECV_B) and a.stage == last or a.op in (RECV_F, SEND_B) and a.stage == first:
                    where = (f"its route ends at stage {last}" if a.op in (SEND_F, RECV_B)
                             else f"its route starts at stage {first}")
                    raise _fail(schedule, rank, a, f"rank {rank}: action {a} has no peer stage "
                                f"{peer_stage(a)} (microbatch {a.microbatch}: {where})")


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
                raise _fail(schedule, rank, a, f"rank {rank}: action {a} appears twice")
            flags[k] = 1
            if op == F:
                continue
            if op == W:
                if not i_seen[k]:
                    raise _fail(schedule, rank, a, f"rank {rank}: action {a} comes before its input-gradient {s}I{mb}")
            elif not f_seen[k]:
                raise _fail(schedule, rank, a, f"rank {rank}: action {a} comes before its forward {s}F{mb}")
            if b_seen[k] and (i_seen[k] or w_seen[k]):
                raise _fail(schedule, rank, a, f"rank {rank}: action {a}: stage {s} microbatch {mb} has both "
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
                raise _fail(schedule, rank, a, f"rank {rank}: action {a} is a duplicate of an earlier {op}")
            if placement[peer_stage(a)] == rank:
                raise _fail(schedule, rank, a, f"rank {rank}: action {a} communicates with stage {peer_stage(a)} "
                                    "on the same rank; same-rank stages exchange nothing")
            table[key] = rank
    for key, rank in sends.items():
        if key not in recvs:
            d, s, mb = key
            src = s - 1 if d == "F" else s + 1
            raise _fail(schedule, rank, Action(SEND_F if d == "F" else SEND_B, src, mb),
                f"rank {rank}: action {src}SEND_{d}{mb} has no matching {s}RECV_{d}{mb} on rank "
                f"{placement[s]}")
    for key, rank in recvs.items():
        if key not in sends:
            d, s, mb = key
            src = s - 1 if d == "F" else s + 1
            raise _fail(schedule, rank, Action(RECV_F if d == "F" else RECV_B, s, mb),
                f"rank {rank}: action {s}RECV_{d}{mb} has no matching {src}SEND_{d}{mb} on rank "
                f"{placement[src]}")


class _Event(IntEnum):
    """What a stuck row waits for (the deadlock pass's flags; a waiting key is
    ``kind * size + index``)."""

    FORWARD = 0       # F of (stage, microbatch) has run; index stage * m + microbatch
    GRADIENT = 1      # its B or I has run
    INPUT_GRAD = 2    # its I has run
    SENT = 3          # a message has been sent; index: its message number
    POSTED = 4        # its receive has been posted (the RECV has run)


def _check_no_deadlock(schedule: "Schedule", direct: bool = False) -> None:
    """Symbolic execution of the lowered rows: asynchronous sends, blocking receives, compute
    waits for its inputs (an overlap's forward part also for its backward part's).

    Events are flags in flat arrays; a rank that cannot move parks itself on the one event it
    waits for and is woken when that event happens. ``direct``: the compute rows only, every
    input read straight from its producer's flag, as if local.
    """
    program = lower(schedule)
    placement = schedule.placement
    m, n = schedule.num_microbatches, schedule.num_stages
    last = n - 1
    size = max(n * m, program.num_messages)
    flags = [bytearray(size) for _ in _Event]
    f_done, g_done, i_done, sent, posted = flags
    prev_local = [s > 0 and (direct or placement[s - 1] == placement[s]) for s in range(n)]
    next_local = [s < last and (direct or placement[s + 1] == placement[s]) for s in range(n)]
    bounds = schedule.route_bounds()
    firsts, lasts = bounds if bounds is not None else ([0] * m, [last] * m)
    rows = [tuple(r for r in rank_rows if r[0] < FIRST_COMM_CODE) if direct else rank_rows
            for rank_rows in program.in_turn]
    waiting: dict[int, list[int]] = {}
    blocked: dict[int, tuple[int, bool, int, int]] = {}   # rank -> (row, at gate, kind, index)
    pointer = [0] * schedule.pp
    work = list(range(schedule.pp))
    FORWARD_, GRADIENT_, INPUT_, SENT_, POSTED_ = (int(e) for e in _Event)

    def backward_wait(s: int, mb: int) -> tuple[int, int] | None:
        """The event a backward of (s, mb) still waits for: its forward, then the gradient of
        its output (from the local next stage, or received); None if neither."""
        k = s * m + mb
        if not f_done[k]:
            return FORWARD_, k
        if s < lasts[mb]:
            if next_local[s]:
                if not g_done[k + m]:
                    return GRADIENT_, k + m
            else:
                msg = message(BACKWARD, s, mb, n, m)
                if not posted[msg]:
                    return POSTED_, msg
        return None

    while work:
        rank = work.pop()
        blocked.pop(rank, None)
        own = rows[rank]
        count = len(own)
        i = pointer[rank]
        while i < count:
            code, s, mb, _, _, _, _, msg, _, _, overlap = own[i]
            k = s * m + mb
            need = None
            gate = False
            key = -1
            if overlap >= 0 and code == CODE_F:
                # The gate of an overlap: its backward part's inputs must be there too before
                # the forward part starts (the parts start together).
                bwd = own[i + 1]                           # a Row: code, stage, microbatch
                need = backward_wait(bwd[1], bwd[2])
                gate = need is not None
            if need is not None:
                pass
            elif code == CODE_F:
                if s > firsts[mb]:
                    if prev_local[s]:
                        if not f_done[k - m]:
                            need = FORWARD_, k - m
                    else:
                        remote = message(FORWARD, s, mb, n, m)
                        if not posted[remote]:
                            need = POSTED_, remote
                if need is None:
                    f_done[k] = 1
                    key = FORWARD_ * size + k
            elif code == CODE_B or code == CODE_I:
                need = backward_wait(s, mb)
                if need is None:
                    g_done[k] = 1
                    key = GRADIENT_ * size + k
                    if code == CODE_I:
                        i_done[k] = 1
                        if waiting:
                            woken = waiting.pop(INPUT_ * size + k, None)
                            if woken:
                                work.extend(woken)
            elif code == CODE_W:
                if not i_done[k]:
                    need = INPUT_, k
            elif code >= FIRST_SHARD_CODE:
                pass                        # a data-parallel collective: waits on no pipeline peer
            elif code == CODE_SEND_F or code == CODE_SEND_B:
                producer = f_done if code == CODE_SEND_F else g_done
                if not producer[k]:
                    need = (FORWARD_ if code == CODE_SEND_F else GRADIENT_), k
                else:
                    sent[msg] = 1
                    key = SENT_ * size + msg
            else:                                          # RECV_F, RECV_B
                if not sent[msg]:
                    need = SENT_, msg
                else:
                    posted[msg] = 1
                    key = POSTED_ * size + msg
            if need is not None:
                waiting.setdefault(need[0] * size + need[1], []).append(rank)
                blocked[rank] = (i, gate, *need)
                break
            if waiting and key >= 0:
                woken = waiting.pop(key, None)
                if woken:
                    work.extend(woken)
            i += 1
        pointer[rank] = i

    if blocked:
        stuck, marks = [], []
        for r, (i, gate, kind, index) in sorted(blocked.items()):
            row = Row(*rows[r][i])
            action = Overlap(row.action, Row(*rows[r][i + 1]).action) if gate else row.action
            words = _waited_for(action, kind, index, n, m, placement)
            stuck.append(f"rank {r} is stuck at {action} waiting for {words}")
            marks.append((r, _row_step(rows[r], i), action))
        lists = [schedule.actions(q) for q in range(schedule.pp)]
        rank, step, action = marks[0]
        grid = format_grid(lists, step, rank, [(q, k) for q, k, _ in marks])
        raise ScheduleError(f"deadlock: {'; '.join(stuck)}", rank=rank, step=step, action=action,
                            grid=grid)


def _row_step(rows, i: int) -> int:
    """The step (position in the rank's action list) of its row ``i``: an overlap's two parts
    are one action."""
    return i - sum(1 for r in map(Row._make, rows[:i]) if r.overlap >= 0 and r.code != CODE_F)


def _waited_for(action: Action, kind: int, index: int, n: int, m: int,
                placement: tuple[int, ...]) -> str:
    """Words for the event a stuck action waits on (see `_Event`)."""
    here = "on this rank"
    if kind == _Event.FORWARD:
        s, mb = divmod(index, m)
        return (f"its forward {s}F{mb}" if s == action.stage and action.op != F
                else f"the forward {s}F{mb} {here}")
    if kind == _Event.GRADIENT:
        s, mb = divmod(index, m)
        return (f"the backward {s}B/I{mb} that produces it" if action.op == SEND_B
                else f"the backward {s}B/I{mb} {here}")
    if kind == _Event.INPUT_GRAD:
        s, mb = divmod(index, m)
        return f"its input-gradient {s}I{mb}"
    direction, s, mb = message_parts(index, n, m)
    if kind == _Event.SENT:
        return (f"{s - 1}SEND_F{mb} from rank {placement[s - 1]}" if direction == FORWARD
                else f"{s + 1}SEND_B{mb} from rank {placement[s + 1]}")
    return (f"a receive {s}RECV_F{mb} of its input" if direction == FORWARD
            else f"a receive {s}RECV_B{mb} of its output gradient")
