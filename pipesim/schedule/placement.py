"""Placement: which rank holds each virtual stage.

Looped (Megatron interleaved): stage ``s`` on rank ``s % pp``.
V-shape (ZB-V, DualPipeV): chunk 0 goes down the ranks, chunk 1 comes back up, and so on
(zig-zag for more chunks), so the first and last stages share rank 0.

A schedule with *copies* (DualPipe) cuts the model into ``pp * vpp`` parts but runs twice as
many stages, stage ``s`` computing part ``s % (pp * vpp)``: each rank holds a part and a copy of
another. :func:`rank_parts` is what each rank holds, from the placement alone: the builders make
their schedules with these functions and the planner reads a plan's ranks from them, without
building a schedule.
"""
from __future__ import annotations

from ..errors import ScheduleError

LOOPED = "looped"
VSHAPE = "v"
PLACEMENTS = (LOOPED, VSHAPE)


def looped(pp: int, vpp: int) -> tuple[int, ...]:
    return tuple(s % pp for s in range(pp * vpp))


def vshape(pp: int, vpp: int) -> tuple[int, ...]:
    out = []
    for s in range(pp * vpp):
        chunk, j = divmod(s, pp)
        out.append(j if chunk % 2 == 0 else pp - 1 - j)
    return tuple(out)


def make_placement(kind: str, pp: int, vpp: int) -> tuple[int, ...]:
    if kind == LOOPED:
        return looped(pp, vpp)
    if kind == VSHAPE:
        return vshape(pp, vpp)
    raise ScheduleError(f"unknown placement {kind!r}: expected one of {', '.join(PLACEMENTS)}")


def placement_kind(placement: tuple[int, ...], pp: int, vpp: int) -> str:
    """Name a placement tuple: 'looped', 'v', or 'custom'."""
    if placement == looped(pp, vpp):
        return LOOPED
    if placement == vshape(pp, vpp):
        return VSHAPE
    return "custom"


def copy_parts(pp: int, vpp: int) -> tuple[int, ...]:
    """Stage -> model part of a schedule with copies: ``2 * pp * vpp`` stages, stage ``s``
    computing part ``s % (pp * vpp)`` (DualPipe: stage ``pp + j`` is a copy of part ``j``)."""
    return tuple(s % (pp * vpp) for s in range(2 * pp * vpp))


def copy_routes(pp: int, vpp: int, microbatches: int) -> list[tuple[int, int]]:
    """First and last stage of each microbatch of a schedule with copies: the first half of
    the microbatches through stages ``0 .. pp*vpp - 1``, the rest through their copies."""
    n, half = pp * vpp, microbatches // 2
    return [(0, n - 1)] * half + [(n, 2 * n - 1)] * (microbatches - half)


def rank_part_runs(kind: str, pp: int, vpp: int, microbatches: int, *, copies: bool = False
                   ) -> tuple[dict[int, int], ...]:
    """Per rank, part -> how many microbatches the rank runs through it: every microbatch
    through every part, or with copies each half through its own stages."""
    held = rank_parts(kind, pp, vpp, copies=copies)
    if not copies:
        return tuple({part: microbatches for part in parts} for parts in held)
    n, half = pp * vpp, microbatches // 2
    place = make_placement(kind, pp, 2 * vpp)
    out: list[dict[int, int]] = [{} for _ in range(pp)]
    for stage, rank in enumerate(place):
        part = stage % n
        out[rank][part] = out[rank].get(part, 0) + (half if stage < n else microbatches - half)
    return tuple(out)


def rank_parts(kind: str, pp: int, vpp: int, *, copies: bool = False
               ) -> tuple[tuple[int, ...], ...]:
    """The model parts each rank holds, in the order of its stages (ascending), for ``pp * vpp``
    parts placed ``kind``; with ``copies`` each rank's stages are twice ``vpp`` and a part held
    twice is listed twice (its weights and gradients count on both ranks)."""
    stages = 2 * vpp if copies else vpp
    place = make_placement(kind, pp, stages)
    parts = copy_parts(pp, vpp) if copies else range(pp * stages)
    held: list[list[int]] = [[] for _ in range(pp)]
    for stage, rank in enumerate(place):
        held[rank].append(parts[stage])
    return tuple(tuple(h) for h in held)
