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

W passes fill the free slots, oldest first (chunk 1's before chunk 0's at the same time), and
whatever is left runs at the end. The rank's order is its passes sorted by slot: every pass sits
at least one slot after what it needs, so the order is deadlock-free.

Memory (chunk activations held from F to W): V-Min about 1/3 and V-Half about 1/2 of 1F1B's
peak (a 1F1B stage is two chunks); the bubble grows as memory shrinks. The reference also
squeezes warm-up and cool-down with a greedy reorder under the same memory; this builder keeps
the plain block order (see tests/test_controllable.py for the figures it reaches).
"""
from __future__ import annotations

from ...errors import ScheduleError
from ..action import F, I, W, Action
from ..placement import VSHAPE
from ..registry import register
from ..schedule import Schedule
from .simple import require_vpp

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


def block_order(kind: str, rank: int, pp: int, microbatches: int) -> list[Action]:
    """The compute order of ``rank``: the block's passes for every microbatch, W in free slots."""
    down, up = rank, 2 * pp - 1 - rank
    f0, f1, i1, i0 = block(kind, pp, rank)
    at: dict[int, Action] = {}
    for k in range(microbatches):
        for slot, action in ((f0, Action(F, down, k)), (f1, Action(F, up, k)),
                             (i1, Action(I, up, k)), (i0, Action(I, down, k))):
            t = slot + PERIOD * k
            if t in at:
                raise ScheduleError(f"{kind}: block slots collide at {t} on rank {rank} "
                                    f"({at[t]} and {action})")
            at[t] = action
    order: list[Action] = []
    pending = {up: [], down: []}      # microbatches whose I ran and whose W has not
    for t in range(max(at) + 1):
        action = at.get(t)
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
    require_vpp(kind, vpp, 2, " (rank r holds stages r and 2*pp-1-r)")
    orders = [block_order(kind, r, pp, microbatches) for r in range(pp)]
    if forward_only:
        orders = [[a for a in order if a.op == F] for order in orders]
    return Schedule(pp, 2, microbatches, VSHAPE, orders, name=kind, forward_only=forward_only)


@register("v-min", placement=VSHAPE, constraints="vpp == 2",
          description="V-Min (Qi et al. 2024, controllable memory): V placement, about 1/3 of "
                      "1F1B's activation memory, bubble between ZB-V's and 1F1B's")
def v_min(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    return _build("v-min", pp, vpp, microbatches, forward_only)


@register("v-half", placement=VSHAPE, constraints="vpp == 2",
          description="V-Half (Qi et al. 2024, controllable memory): V placement, about 1/2 of "
                      "1F1B's activation memory, bubble between ZB-V's and 1F1B's")
def v_half(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    return _build("v-half", pp, vpp, microbatches, forward_only)
