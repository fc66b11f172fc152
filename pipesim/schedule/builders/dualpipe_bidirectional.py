"""DualPipe: DeepSeek's bidirectional pipeline (DeepSeek-V3 report, arXiv 2412.19437;
``dualpipe/dualpipe.py`` of github.com/deepseek-ai/DualPipe).

Every rank holds two copies' worth of parameters: model part ``r`` for the microbatches fed at
rank 0 (direction A) and model part ``pp-1-r`` for those fed at rank ``pp-1`` (direction B).
In the IR that is the V placement with routes and copies: stages ``0..pp-1`` (stage ``s`` on
rank ``s``, part ``s``) carry the first half of the microbatches, stages ``pp..2pp-1`` (stage
``pp+j`` on rank ``pp-1-j``, a copy of part ``j``) the second half; the two directions meet on
the middle ranks and never cross there.

The per-rank order is the reference's ``step``: rank ``r`` runs the order of DualPipeV's rank
``h = min(r, pp-1-r)`` on ``pp/2`` ranks over ``m/2`` microbatches (DualPipeV is DualPipe "cut
in half"), with DualPipeV's chunk 0 ("phase 0", the stage closer to where its microbatches are
fed) being direction A on the first half of the ranks and direction B on the second half. So the
bubble is (PP/2 - 1)(F&B + B - 3W) and the peak PP + 1 in-flight activations of a stage, as the
DualPipe README's table states, with 2x the parameters per rank.
"""
from __future__ import annotations

from ...errors import ScheduleError
from ..action import F, Action, Overlap
from ..placement import VSHAPE, copy_parts, copy_routes
from ..registry import register
from ..schedule import Schedule
from .dualpipe import dualpipev_order


def dualpipe_routes(pp: int, microbatches: int) -> list[tuple[int, int]]:
    """First and last stage of each microbatch: the first half down, the second half up."""
    return copy_routes(pp, 1, microbatches)


def dualpipe_stage_parts(pp: int) -> list[int]:
    """Stage ``s`` computes model part ``s % pp``: stage ``pp+j`` is a copy of part ``j``."""
    return list(copy_parts(pp, 1))


def dualpipe_order(rank: int, pp: int, microbatches: int) -> list[Action]:
    """The compute order of ``rank`` (the reference's ``DualPipe.step``, step for step)."""
    half_ranks, half = pp // 2, microbatches // 2
    h = min(rank, pp - 1 - rank)
    a_stage, b_stage = rank, 2 * pp - 1 - rank       # direction A's and direction B's stage here
    v_down, v_up = h, 2 * half_ranks - 1 - h         # DualPipeV's chunk 0 and chunk 1 on rank h
    second_half = rank >= half_ranks
    # phase 0 is direction A on the first half of the ranks, direction B on the second half
    to_stage = {v_down: b_stage if second_half else a_stage,
                v_up: a_stage if second_half else b_stage}

    def mapped(a: Action) -> Action:
        stage = to_stage[a.stage]
        return Action(a.op, stage, a.microbatch + (half if stage == b_stage else 0))

    out: list[Action] = []
    for a in dualpipev_order(h, half_ranks, half):
        out.append(Overlap(*(mapped(p) for p in a.parts)) if len(a.parts) == 2 else mapped(a))
    return out


def _check(pp: int, vpp: int, microbatches: int) -> None:
    if vpp != 1:
        raise ScheduleError(
            f"dualpipe needs vpp == 1, got vpp = {vpp}: the model is cut into pp parts, one per "
            "rank, and each rank also holds a copy of part pp-1-r for the microbatches fed from "
            "the other end (the schedule has 2 stages per rank: its vpp is 2)")
    if pp % 2:
        raise ScheduleError(f"dualpipe needs an even pp (ranks pair up from both ends, as "
                            f"DeepSeek's DualPipe asserts), got pp = {pp}")
    if microbatches % 2 or microbatches < 2 * pp:
        raise ScheduleError(
            f"dualpipe needs an even number of microbatches >= 2*pp = {2 * pp} (half fed at each "
            f"end, each half >= pp so that the overlapped steady state exists; DeepSeek's "
            f"DualPipe asserts the same), got {microbatches}")


@register("dualpipe", placement=VSHAPE, check=_check, copies=True, overlapped=True,
          constraints="pp even, microbatches even and >= 2*pp (as DeepSeek's DualPipe); "
                      "vpp == 1 (pp model parts; each rank holds part r and a copy of part "
                      "pp-1-r, so the schedule's vpp is 2)",
          description="DualPipe (DeepSeek): bidirectional, half the microbatches fed at each "
                      "end, two copies of the parameters, overlapped F&B steady state")
def dualpipe(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    _check(pp, vpp, microbatches)
    orders = [dualpipe_order(r, pp, microbatches) for r in range(pp)]
    if forward_only:
        orders = [[p for a in order for p in a.parts if p.op == F] for order in orders]
    return Schedule(pp, 2, microbatches, VSHAPE, orders, name="dualpipe",
                    forward_only=forward_only, routes=dualpipe_routes(pp, microbatches),
                    stage_parts=dualpipe_stage_parts(pp))
