"""ZB-V: the Zero Bubble V schedule (Qi et al., ICLR 2024, the ZB-V section).

Two chunks per rank in V placement: rank r holds stage r (chunk 0, going down the ranks) and
stage 2p-1-r (chunk 1, coming back up), so the last stage and the loss sit on rank 0 next to the
first stage. Each stage holds half the layers of a 1F1B stage; costs below are per chunk.

Order on rank r (p = pp, n = max(m, 2p - 1), the handcrafted order of the reference
implementation, sail-sg/zero-bubble-pipeline-parallelism ``get_zb_v_schedule``):

1. warm-up: 2(p - r) - 1 chunk-0 forwards, then r pairs (chunk-1 F, chunk-0 F);
2. p - r triples (chunk-1 F, I, W): the bottom of the V turns around;
3. steady: (chunk-0 F, I, W, chunk-1 F, I, W) until every forward has run;
4. cool-down: r pairs (chunk-0 I, chunk-1 I), then p - r pairs (chunk-0 I, oldest chunk-0 W),
   then the remaining chunk-1 W passes, then the remaining chunk-0 W passes.

The order is built for n microbatches and the actions of microbatches >= m are dropped, which
keeps it valid for every m >= 1 (a sub-sequence of an executable order is executable).

What the order achieves (list scheduling, zero communication), for m >= 2p - 1 and
F = I = W = c per chunk: no rank ever idles between its first and its last action (rank r
starts at r*c, rank 0 runs without a gap from 0 to 6mc), i.e. zero bubble in the paper's sense.

Memory: at most min(2p, 2m) chunk-microbatches whose F ran and whose W has not, on every rank;
a chunk-microbatch holds half a 1F1B stage's activations, so that is p 1F1B microbatches, the
peak of 1F1B's rank 0. (ZB-V's claim is the same peak as 1F1B, balanced over ranks.)
"""
from __future__ import annotations

from ..action import F, I, W, Action
from ..placement import VSHAPE
from ..registry import register
from ..schedule import Schedule
from .simple import vpp_check

_check = vpp_check("zbv", 2, " (rank r holds stages r and 2*pp-1-r)")


def zbv_order(rank: int, pp: int, microbatches: int) -> list[Action]:
    """The compute order of ``rank`` (see the module docstring for the phases)."""
    n = max(microbatches, 2 * pp - 1)
    down, up = rank, 2 * pp - 1 - rank          # stages of chunk 0 and chunk 1
    nf = {down: 0, up: 0}                       # next microbatch per (op, stage)
    ni = {down: 0, up: 0}
    nw = {down: 0, up: 0}
    order: list[Action] = []

    def run(op: str, stage: int) -> None:
        counter = nf if op == F else ni if op == I else nw
        order.append(Action(op, stage, counter[stage]))
        counter[stage] += 1

    for _ in range(2 * (pp - rank) - 1):
        run(F, down)
    for _ in range(rank):
        run(F, up)
        run(F, down)
    for _ in range(pp - rank):
        run(F, up)
        run(I, up)
        run(W, up)
    while nf[up] < nf[down] or nf[down] < n:
        if nf[down] < n:
            run(F, down)
        run(I, down)
        run(W, down)
        run(F, up)
        run(I, up)
        run(W, up)
    for _ in range(rank):
        run(I, down)
        run(I, up)
    for _ in range(pp - rank):
        run(I, down)
        run(W, down)
    while nw[up] < n:
        run(W, up)
    while nw[down] < n:
        run(W, down)
    return [a for a in order if a.microbatch < microbatches]


@register("zbv", placement=VSHAPE, check=_check, searched_vpp=2, split_backward=True,
          constraints="vpp == 2; zero bubble for F = I = W, m >= 2*pp - 1",
          description="Zero Bubble V: two chunks per rank in V placement (rank r holds stages r "
                      "and 2pp-1-r); zero bubble when F = I = W with 1F1B's peak memory")
def zbv(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    _check(pp, vpp, microbatches)
    orders = [zbv_order(r, pp, microbatches) for r in range(pp)]
    if forward_only:
        # The training order's forwards keep both chunks of the V busy in turn.
        orders = [[a for a in order if a.op == F] for order in orders]
    return Schedule(pp, 2, microbatches, VSHAPE, orders, name="zbv", forward_only=forward_only)
