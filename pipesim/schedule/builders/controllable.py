"""V-Half and V-Min: the controllable-memory V schedules (Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024, arXiv 2405.15362).

Two chunks per rank in V placement, as ZB-V: rank r holds stage r (chunk 0) and 2p-1-r (chunk
1), p = pp. The paper builds a schedule from a *building block*: the slots, in a period of 6
(one F, one I and one W per chunk), at which each rank runs the four passes of one microbatch,
repeated every 6 slots for the next microbatch. The block's lifespan (first F to last I of a
microbatch on a rank) sets the activation memory; its interval sets the bubble. Slots of rank
r for microbatch k (``+ 6k``), the block of the reference generator (sail-sg/zero-bubble-
pipeline-parallelism, ``zbv_greedy.py``, ``stable_pattern_v_min`` / ``_v_half``):

=========  ===========  ===============  =====================  =====================
schedule   F chunk 0    F chunk 1        I chunk 1              I chunk 0
=========  ===========  ===============  =====================  =====================
v-min      r            2p - 1 - r       2p + d + r             4p + d - 1 - r          d = 2 if p % 3 == 0 else 0
v-half     2r           3p - 2 - r       3p + d + 2r - 1        6p + d - 2 - r          d = 3 if p % 2 == 0 else 0
=========  ===========  ===============  =====================  =====================

Then the squeeze (the paper's name for it): in slot order, every pass moves to the earliest
free slot after its inputs that keeps its rank's peak memory within the block's, which removes
most of the gaps of warm-up and cool-down. W passes fill the free slots, oldest first (chunk 1's
before chunk 0's at the same time), and whatever is left runs at the end. The rank's order is
its passes sorted by slot: every pass sits at least one slot after what it needs, so the order
is deadlock-free.

Memory (chunk activations held from F to W): floor(p/2)+1 (V-Half) and floor((p+1)/3)+1
(V-Min) microbatches of a 1F1B stage (two chunks) at the peak, against 1F1B's p: about 1/2 and
1/3. Bubble (F = I = W): about 0.3-0.45 and 0.55-0.65 of 1F1B's (tests/test_controllable.py).
"""
from __future__ import annotations

from bisect import bisect_left, insort

from ...errors import ScheduleError
from ..action import F, I, W, Action
from ..placement import VSHAPE
from ..registry import register
from ..schedule import Schedule
from .simple import vpp_check

PERIOD = 6


def block(kind: str, pp: int, rank: int) -> tuple[int, int, int, int]:
    """Slots of (F chunk 0, F chunk 1, I chunk 1, I chunk 0) of microbatch 0 on ``rank``."""
    if kind == "v-min":
        d = 2 if pp % 3 == 0 else 0
        return rank, 2 * pp - 1 - rank, 2 * pp + d + rank, 4 * pp + d - 1 - rank
    if kind == "v-half":
        d = 3 if pp % 2 == 0 else 0
        return 2 * rank, 3 * pp - 2 - rank, 3 * pp + d + 2 * rank - 1, 6 * pp + d - 2 - rank
    raise ScheduleError(f"unknown controllable-memory block {kind!r}")


def _slots(kind: str, pp: int, microbatches: int) -> dict[tuple[int, int, int], int]:
    """(rank, pass, microbatch) -> slot of the repeated block; passes 0..3 are F chunk 0,
    F chunk 1, I chunk 1, I chunk 0."""
    out = {}
    for r in range(pp):
        b = block(kind, pp, r)
        for t in range(4):
            for k in range(microbatches):
                out[(r, t, k)] = b[t] + PERIOD * k
    return out


def _inputs(pp: int, r: int, t: int, k: int) -> list[tuple[int, int, int]]:
    """The passes that (rank r, pass t, microbatch k) needs first: its predecessor in
    microbatch order, and its input (down the V for chunk 0's F and chunk 1's I, back up for
    the others; the turn at the bottom and at the loss on the same rank)."""
    need = [(r, t, k - 1)] if k else []
    if t == 0:
        need += [(r - 1, 0, k)] if r else []
    elif t == 1:
        need.append((r + 1, 1, k) if r < pp - 1 else (r, 0, k))
    elif t == 2:
        need.append((r - 1, 2, k) if r else (r, 1, k))
    else:
        need.append((r + 1, 3, k) if r < pp - 1 else (r, 2, k))
    return need


def squeezed_slots(kind: str, pp: int, microbatches: int) -> dict[tuple[int, int, int], int]:
    """The block's slots with every pass moved to the earliest free slot after its inputs that
    keeps the rank's peak within the block's (worst rank) peak: in slot order, so that inputs
    have moved first. This removes most of the warm-up and cool-down gaps of the plain
    repetition (the paper's and the reference generator's "squeeze")."""
    slots = _slots(kind, pp, microbatches)
    ranks = [_Rank() for _ in range(pp)]
    for (r, t, k), slot in slots.items():
        ranks[r].kind[slot] = t
    limit = max([rank.recount() for rank in ranks], default=0)
    for key in sorted(slots, key=lambda x: (slots[x], x)):
        r, t, k = key
        now = slots[key]
        earliest = max([slots[d] + 1 for d in _inputs(pp, r, t, k)], default=0)
        rank = ranks[r]
        for slot in range(earliest, now):
            if slot not in rank.kind and rank.move(t, now, slot, limit):
                slots[key] = slot
                break
    return slots


class _Rank:
    """One rank's passes during the squeeze and the chunk activations it holds.

    The rule, slot by slot: an F holds one more chunk, an I leaves one to free, and a free
    slot runs the oldest W, freeing one. Only the state (held, pending frees) after each
    occupied slot is kept: across a run of ``n`` free slots it drains by ``min(pending, n)``.
    So a move re-counts the passes between its two slots (a few: the passes that moved before
    it have left a gap there) and the passes after it until the counts agree with the old ones
    again, not every slot in between: linear in the passes, where a slot-by-slot re-count grows
    with the distance moved (about 2 pp a pass for V-Half) and so with pp^2 * m overall."""

    __slots__ = ("kind", "order", "state")

    def __init__(self) -> None:
        self.kind: dict[int, int] = {}             # slot -> pass (0, 1: F; 2, 3: I)
        self.order: list[int] = []                 # occupied slots, ascending
        self.state: dict[int, tuple[int, int]] = {}   # occupied slot -> (held, pending) after it

    def recount(self) -> int:
        """Count every slot afresh; the peak held."""
        self.order = sorted(self.kind)
        held = pending = peak = 0
        prev = -1
        for q in self.order:
            d = min(pending, q - prev - 1)
            held, pending = held - d, pending - d
            if self.kind[q] < 2:
                held += 1
                peak = max(peak, held)
            else:
                pending += 1
            self.state[q] = (held, pending)
            prev = q
        return peak

    def move(self, t: int, now: int, slot: int, limit: int) -> bool:
        """Move pass ``t`` from ``now`` to the free ``slot`` (earlier) if the held count stays
        within ``limit`` everywhere; say whether it moved."""
        order, kind, state = self.order, self.kind, self.state
        i = bisect_left(order, slot)
        held = pending = 0
        if i:
            prev = order[i - 1]
            held, pending = state[prev]
            d = min(pending, slot - 1 - prev)
            held, pending = held - d, pending - d
        if t < 2:
            held += 1
            if held > limit:
                return False
        else:
            pending += 1
        changed = {slot: (held, pending)}
        prev, n = slot, len(order)
        while i < n:
            q = order[i]
            i += 1
            if q == now:                  # free after the move
                continue
            d = min(pending, q - prev - 1)
            held, pending = held - d, pending - d
            if kind[q] < 2:
                held += 1
                if held > limit:
                    return False
            else:
                pending += 1
            prev = q
            if q > now and state[q] == (held, pending):
                break                     # the same counts from here on
            changed[q] = (held, pending)
        del kind[now], state[now]
        order.pop(bisect_left(order, now))
        kind[slot] = t
        insort(order, slot)
        state.update(changed)
        return True


def block_order(kind: str, rank: int, pp: int, microbatches: int, *,
                squeeze: bool = True) -> list[Action]:
    """The compute order of ``rank``: the (squeezed) block's passes in slot order, each W in
    the first free slot after its I (the oldest first, chunk 1's before chunk 0's)."""
    slots = squeezed_slots(kind, pp, microbatches) if squeeze else _slots(kind, pp, microbatches)
    return _rank_order(slots, rank, pp)


def _rank_order(slots: dict[tuple[int, int, int], int], rank: int, pp: int) -> list[Action]:
    down, up = rank, 2 * pp - 1 - rank
    names = ((F, down), (F, up), (I, up), (I, down))
    at: dict[int, Action] = {}
    for (r, t, k), slot in slots.items():
        if r != rank:
            continue
        if slot in at:
            raise ScheduleError(f"block slots collide at {slot} on rank {rank}")
        at[slot] = Action(names[t][0], names[t][1], k)
    order: list[Action] = []
    pending = {up: [], down: []}      # microbatches whose I ran and whose W has not
    for slot in range(max(at) + 1):
        action = at.get(slot)
        if action is not None:
            order.append(action)
            if action.op == I:
                pending[action.stage].append(action.microbatch)
            continue
        for stage in (up, down):       # a free slot: the oldest W, chunk 1 first
            if pending[stage]:
                order.append(Action(W, stage, pending[stage].pop(0)))
                break
    for stage in (up, down):
        order += [Action(W, stage, k) for k in pending[stage]]
    return order


def _build(kind: str, pp: int, vpp: int, microbatches: int, forward_only: bool) -> Schedule:
    _CHECKS[kind](pp, vpp, microbatches)
    mine: list[dict] = [{} for _ in range(pp)]          # each rank's passes and their slots
    for key, slot in squeezed_slots(kind, pp, microbatches).items():
        mine[key[0]][key] = slot
    orders = [_rank_order(mine[r], r, pp) for r in range(pp)]
    if forward_only:
        orders = [[a for a in order if a.op == F] for order in orders]
    return Schedule(pp, 2, microbatches, VSHAPE, orders, name=kind, forward_only=forward_only)


_CHECKS = {kind: vpp_check(kind, 2, " (rank r holds stages r and 2*pp-1-r)")
           for kind in ("v-min", "v-half")}


@register("v-min", placement=VSHAPE, constraints="vpp == 2", check=_CHECKS["v-min"],
          searched_vpp=2, split_backward=True,
          description="V-Min (Qi et al. 2024, controllable memory): V placement, about 1/3 of "
                      "1F1B's activation memory, bubble between ZB-V's and 1F1B's")
def v_min(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    return _build("v-min", pp, vpp, microbatches, forward_only)


@register("v-half", placement=VSHAPE, constraints="vpp == 2", check=_CHECKS["v-half"],
          searched_vpp=2, split_backward=True,
          description="V-Half (Qi et al. 2024, controllable memory): V placement, about 1/2 of "
                      "1F1B's activation memory, bubble between ZB-V's and 1F1B's")
def v_half(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    return _build("v-half", pp, vpp, microbatches, forward_only)
