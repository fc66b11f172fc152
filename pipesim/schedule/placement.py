"""Placement: which rank holds each virtual stage.

Looped (Megatron interleaved): stage ``s`` on rank ``s % pp``.
V-shape (ZB-V, DualPipeV): chunk 0 goes down the ranks, chunk 1 comes back up, and so on
(zig-zag for more chunks), so the first and last stages share rank 0.
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
