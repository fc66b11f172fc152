"""DualPipeV: DeepSeek's DualPipe folded into a V (DeepSeek-V3 report, arXiv 2412.19437; the
"cut-in-half" DualPipeV of github.com/deepseek-ai/DualPipe, as torch.distributed.pipelining's
``ScheduleDualPipeV`` builds it).

Two chunks per rank in V placement: rank r holds stage r (chunk 0, down the ranks) and stage
2p-1-r (chunk 1, back up), p = pp. Order on rank r, in the eight steps of the reference code
(``F0``: a forward of chunk 0, ``B1``: a full backward of chunk 1, ``F0&B1``: the two as one
overlapped action, ``OVERLAP_F_B``):

1. 2(p-r-1) x F0;  2. r+1 x (F0, F1);  3. p-r-1 x (I1, W1, F1)  (zero-bubble turn of the V);
4. m-2p+r+1 x (F0&B1, F1&B0)  (the overlapped steady state; on the last rank the first
   F0&B1 runs as F0 then B1, to shorten the bubble);
5. p-r-1 x (B1, F1&B0);  6. r+1 x (B1, B0), the second half as I (zero bubble: W deferred);
7. p-r-1 x (W, B0 or I0);  8. r+1 x W  (the deferred weight gradients, oldest first).

What it achieves (DualPipe README, "Pipeline Bubbles and Memory Usage Comparison", with F, B,
W the times of a forward, a full backward and a weight backward of one chunk and F&B the time
of an overlapped pair): a bubble of (PP/2 - 1)(F&B + B - 3W) for DualPipe on PP ranks, i.e.
(p - 1)(F&B + B - 3W) for DualPipeV on p ranks, and PP + 1 in-flight activations of a
1F1B-size stage (2p + 1 chunk-microbatches: rank 0's peak) for 2x the parameters in DualPipe,
1x in DualPipeV. ``tests/test_dualpipe.py`` checks both against the simulator.
"""
from __future__ import annotations

from ...errors import ScheduleError
from ..action import B, F, I, W, Action, Overlap
from ..placement import VSHAPE
from ..registry import register
from ..schedule import Schedule
from .simple import require_vpp


def dualpipev_order(rank: int, pp: int, microbatches: int) -> list[Action]:
    """The compute order of ``rank`` (torch's ``ScheduleDualPipeV._calculate_single_rank_
    operations``, step for step)."""
    down, up = rank, 2 * pp - 1 - rank
    nf = {down: 0, up: 0}            # next forward microbatch per stage
    nb = {down: 0, up: 0}            # next backward (B or I) microbatch per stage
    pending_w: list[tuple[int, int]] = []
    order: list[Action] = []

    def forward(stage: int) -> Action:
        a = Action(F, stage, nf[stage])
        nf[stage] += 1
        return a

    def backward(stage: int, op: str = B) -> Action:
        a = Action(op, stage, nb[stage])
        nb[stage] += 1
        if op == I:
            pending_w.append((stage, a.microbatch))
        return a

    def weight() -> None:
        if pending_w:
            stage, mb = pending_w.pop(0)
            order.append(Action(W, stage, mb))

    def overlap(fwd_stage: int, bwd_stage: int) -> None:
        order.append(Overlap(forward(fwd_stage), backward(bwd_stage)))

    for _ in range(2 * (pp - rank - 1)):                       # 1: F0
        order.append(forward(down))
    for _ in range(rank + 1):                                  # 2: F0 F1
        order.append(forward(down))
        order.append(forward(up))
    for _ in range(pp - rank - 1):                             # 3: I1 W1 F1
        order.append(backward(up, I))
        weight()
        order.append(forward(up))
    for i in range(microbatches - 2 * pp + rank + 1):          # 4: F0&B1, F1&B0
        if i == 0 and rank == pp - 1:
            order.append(forward(down))                        # not overlapped: less bubble
            order.append(backward(up))
        else:
            overlap(down, up)
        overlap(up, down)
    for _ in range(pp - rank - 1):                             # 5: B1, F1&B0
        order.append(backward(up))
        overlap(up, down)
    zero_bubble = False
    steps = rank + 1
    for i in range(steps):                                     # 6: B1 B0, later half as I
        if i == steps // 2 and rank % 2 == 1:
            zero_bubble = True
        order.append(backward(up, I if zero_bubble else B))
        if i == steps // 2 and rank % 2 == 0:
            zero_bubble = True
        order.append(backward(down, I if zero_bubble else B))
    for _ in range(pp - rank - 1):                             # 7: W, B0
        weight()
        order.append(backward(down, I if zero_bubble else B))
    for _ in range(rank + 1):                                  # 8: W
        weight()
    return order


def _check(pp: int, vpp: int, microbatches: int) -> None:
    require_vpp("dualpipev", vpp, 2, " (rank r holds stages r and 2*pp-1-r)")
    if microbatches < 2 * pp:
        raise ScheduleError(
            f"dualpipev needs microbatches >= 2*pp = {2 * pp} (as many as stages, so that the "
            f"overlapped steady state exists), got {microbatches}")


@register("dualpipev", placement=VSHAPE, check=_check, searched_vpp=2, overlapped=True,
          constraints="vpp == 2, microbatches >= 2*pp (as torch's ScheduleDualPipeV)",
          description="DualPipeV (DeepSeek): V placement, overlapped forward-and-backward "
                      "(OVERLAP_F_B) steady state, zero-bubble cool-down with deferred W")
def dualpipev(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    _check(pp, vpp, microbatches)
    orders = [dualpipev_order(r, pp, microbatches) for r in range(pp)]
    if forward_only:
        orders = [[p for a in order for p in a.parts if p.op == F] for order in orders]
    return Schedule(pp, 2, microbatches, VSHAPE, orders, name="dualpipev",
                    forward_only=forward_only)
