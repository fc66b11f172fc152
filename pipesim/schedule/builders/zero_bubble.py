"""ZB-H1 and ZB-H2: the handcrafted Zero Bubble schedules (Qi et al., ICLR 2024, Figure 3).

The backward pass is split into I (input gradient, on the critical path from stage to stage) and
W (weight gradient, needed by nobody but the optimizer). Both schedules are 1F1B-shaped: a rank
runs some warm-up forwards, then after every I it may run the oldest pending W, then the next F.
The two differ in two numbers per rank r (p = pp): how many forwards run before the first I,
and the "W lag" L (below).

* ZB-H1: p - r forwards first (as 1F1B), W lag r. With list scheduling, zero communication,
  m >= p and costs with W <= min(F, I), every rank idles exactly (p-1)(F+I-W) over the step
  (makespan - busy; for rank 0 that idle lies inside its own span): the W passes fill 1F1B's
  cool-down, a third of 1F1B's bubble when F = I = W.
* ZB-H2: 2(p - r) - 1 forwards first, W lag 2r. With m >= 2p - 1 and W <= min(F, I) the step is
  a parallelogram: rank r idles exactly (p-1-r)(F+I-2W) between its first and its last action,
  so the first rank's bubble is (p-1)(F+I-2W), zero when F = I = W. (Rank r cannot start before
  r*F, so the makespan is m(F+I+W) + (p-1)*max(F, F+I-2W); the paper counts the parallelogram,
  whose start offsets overlap the previous step once the optimizer step is not synchronised.)

"W lag L" means: a W runs right after an I only when more than L input gradients are waiting
for their W, so rank r delays its W passes by L steps and runs them in the cool-down, where it
would otherwise wait for input gradients from the ranks below it. This is the rule of
torch.distributed.pipelining's ScheduleInterleavedZeroBubble (W from step ``rank`` on) for ZB-H1.

Memory, counted in microbatches whose forward ran and whose W has not (per rank):

* ZB-H1: at most min(p, m) on *every* rank; of those at most min(p - r, m) still hold their full
  activations (I not run): exactly 1F1B's count. The rest hold only what W needs. This is the
  paper's claim: the peak over all ranks does not exceed 1F1B's (rank 0 holds p in both).
  Holding only p - r microbatches short of W on rank r is *not* compatible with the bubble
  (p-1)(F+I-W): the last rank would then have to run F I W F I W ..., so with unit costs
  its last I could not start before 3m + p - 3 and rank 0's last I could not end before
  3m + 2p - 3, past the 3m + p - 1 that the bubble allows when p > 2.
* ZB-H2: at most min(2p - 1, m) on every rank (the paper's (2p-1) M_B); full activations at most
  min(2(p - r) - 1, m).

Fewer microbatches than the minimum still give valid (smaller) orders: the warm-up is capped at
m, and the formulas above simply no longer hold.
"""
from __future__ import annotations

from ..action import F, I, W, Action
from ..placement import LOOPED
from ..registry import register
from ..schedule import Schedule
from .simple import vpp_check

_h1_check = vpp_check("zb-h1", 1, " (use zbv for two chunks per rank)")
_h2_check = vpp_check("zb-h2", 1, " (use zbv for two chunks per rank)")


def split_backward_order(stage: int, warmup: int, w_lag: int, microbatches: int) -> list[Action]:
    """One rank's order: ``warmup`` forwards, then I, [oldest pending W], next F, repeated.

    A W runs after an I only while more than ``w_lag`` microbatches wait for their W; the W
    passes left at the end run last. Microbatches go in order within each op.
    """
    warmup = min(warmup, microbatches)
    order = [Action(F, stage, mb) for mb in range(warmup)]
    next_f, next_w = warmup, 0
    for mb in range(microbatches):
        order.append(Action(I, stage, mb))
        if mb + 1 - next_w > w_lag:
            order.append(Action(W, stage, next_w))
            next_w += 1
        if next_f < microbatches:
            order.append(Action(F, stage, next_f))
            next_f += 1
    order += [Action(W, stage, mb) for mb in range(next_w, microbatches)]
    return order


def _forward_only(pp: int, microbatches: int) -> list[list[Action]]:
    return [[Action(F, r, mb) for mb in range(microbatches)] for r in range(pp)]


@register("zb-h1", placement=LOOPED, check=_h1_check, split_backward=True,
          constraints="vpp == 1; bubble (p-1)(F+I-W) for m >= pp, W <= min(F, I)",
          description="Zero Bubble H1: 1F1B with the backward split into I and W; W passes delayed "
                      "by r steps on rank r fill the cool-down (1F1B's peak memory)")
def zb_h1(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    _h1_check(pp, vpp, microbatches)
    if forward_only:
        orders = _forward_only(pp, microbatches)
    else:
        orders = [split_backward_order(r, pp - r, r, microbatches) for r in range(pp)]
    return Schedule(pp, 1, microbatches, LOOPED, orders, name="zb-h1", forward_only=forward_only)


@register("zb-h2", placement=LOOPED, check=_h2_check, split_backward=True,
          constraints="vpp == 1; bubble (p-1)(F+I-2W), zero for F = I = W, m >= 2*pp - 1",
          description="Zero Bubble H2: 2(p-r)-1 warm-up forwards and W delayed 2r steps on rank r "
                      "fill warm-up and cool-down (peak memory 2p-1 microbatches)")
def zb_h2(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    _h2_check(pp, vpp, microbatches)
    if forward_only:
        orders = _forward_only(pp, microbatches)
    else:
        orders = [split_backward_order(r, 2 * (pp - r) - 1, 2 * r, microbatches) for r in range(pp)]
    return Schedule(pp, 1, microbatches, LOOPED, orders, name="zb-h2", forward_only=forward_only)
