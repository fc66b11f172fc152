"""Unit-time steps: when each compute action would run if every F, B, I, W took one step.

Used to draw a schedule as a grid in a terminal (`pipesim show`) without the simulator. Zero
communication cost; an action starts once its rank is free and its inputs exist.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .action import B, F, I, W, Action

if TYPE_CHECKING:
    from .schedule import Schedule


def unit_steps(schedule: "Schedule") -> list[list[tuple[int, Action]]]:
    """Per rank, ``(step, action)`` for each compute action (an overlap's parts take one step
    each, back to back). The schedule must be valid."""
    schedule.validate()
    first_of, last_of = schedule.first_stage, schedule.last_stage
    finish: dict[tuple[str, int, int], int] = {}   # ("F"|"G"|"I", stage, mb) -> end step
    orders = [schedule.compute_order(r) for r in range(schedule.pp)]
    pos = [0] * schedule.pp
    free = [0] * schedule.pp
    out: list[list[tuple[int, Action]]] = [[] for _ in range(schedule.pp)]
    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(orders):
            while pos[rank] < len(order):
                parts = order[pos[rank]].parts      # an overlap: its parts, one step each
                deps = []
                for op, s, mb in parts:
                    if op == F:
                        deps += [("F", s - 1, mb)] if s > first_of(mb) else []
                    elif op == W:
                        deps += [("I", s, mb)]
                    else:
                        deps += [("F", s, mb)] + ([("G", s + 1, mb)] if s < last_of(mb) else [])
                if any(d not in finish for d in deps):
                    break
                start = max([free[rank]] + [finish[d] for d in deps])
                for a in parts:
                    op, s, mb = a
                    free[rank] = start + 1
                    out[rank].append((start, a))
                    if op == F:
                        finish[("F", s, mb)] = start + 1
                    elif op in (B, I):
                        finish[("G", s, mb)] = start + 1
                        if op == I:
                            finish[("I", s, mb)] = start + 1
                    start += 1
                pos[rank] += 1
                progress = True
    return out
