"""Coordination of a save across ranks: a store barrier that names who is missing, and the
gathering of the data-parallel replicas' RNG states onto their group's writer.

The barrier goes through the c10d store rather than a collective so that a timeout can say
which ranks never arrived (a collective only says that it timed out), and so that it works the
same with gloo and NCCL. Every wait has a deadline.
"""
from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from .errors import CheckpointError


def store_barrier(store: Any, name: str, rank: int, world_size: int, timeout: float) -> None:
    """Block until all ``world_size`` ranks reached barrier ``name`` (unique per use)."""
    if world_size == 1:
        return
    store.set(f"{name}/{rank}", b"1")
    keys = [f"{name}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout
    pause = 0.002
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"{name}/{r}"])]
            raise CheckpointError(f"checkpoint barrier {name!r} timed out after {timeout:g} s "
                                  f"waiting for ranks {missing}", field="barrier")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def gather_to_writer(obj: Any, group: Any, group_size: int) -> list[Any] | None:
    """Every member's ``obj`` in group-rank order on the group's rank 0; None elsewhere.

    With ``group is None`` (no data parallelism) the caller is its own writer.
    """
    if group is None or group_size == 1:
        return [obj]
    out = [None] * group_size
    dist.all_gather_object(out, obj, group=group)
    return out if dist.get_rank(group) == 0 else None
