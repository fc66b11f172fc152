"""Coordination of a save across ranks: a store barrier that names who is missing, and the
gathering of the data-parallel replicas' RNG states onto their group's writer.

The barrier goes through the c10d store rather than a collective so that a timeout can say
which ranks never arrived (a collective only says that it timed out), and so that it works the
same with gloo and NCCL. Every wait has a deadline.
"""
from __future__ import annotations

import datetime
import time
import uuid
from typing import Any

import torch.distributed as dist

from .errors import CheckpointError


def _wait(store: Any, done, what: str, timeout: float, missing) -> None:
    deadline = time.monotonic() + timeout
    pause = 0.002
    while not done():
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint barrier {what!r} timed out after {timeout:g} s "
                                  f"waiting for ranks {missing()}", field="barrier")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def store_barrier(store: Any, name: str, rank: int, world_size: int, timeout: float) -> None:
    """Block until all ``world_size`` ranks reached barrier ``name`` (unique per use).

    Two phases: every rank announces its arrival and waits for all arrivals; then every rank
    announces it has seen them, and rank 0 (which hosts the store under the local launcher and
    torchrun-less runs) waits for those acknowledgements too, so it cannot exit and take the
    store down while a peer is still polling it.
    """
    if world_size == 1:
        return
    keys = [f"{name}/{r}" for r in range(world_size)]
    store.set(keys[rank], b"1")
    _wait(store, lambda: store.check(keys), name, timeout,
          lambda: [r for r in range(world_size) if not store.check([keys[r]])])
    left = store.add(f"{name}/left", 1)
    if rank == 0 and left < world_size:
        _wait(store, lambda: store.add(f"{name}/left", 0) >= world_size, name + " (exit)",
              timeout, lambda: f"{world_size - store.add(f'{name}/left', 0)} rank(s) unacknowledged")


def gather_to_writer(obj: Any, group: Any, group_size: int) -> list[Any] | None:
    """Every member's ``obj`` in group-rank order on the group's rank 0; None elsewhere.

    With ``group is None`` (no data parallelism) the caller is its own writer.
    """
    if group is None or group_size == 1:
        return [obj]
    out = [None] * group_size
    dist.all_gather_object(out, obj, group=group)
    return out if dist.get_rank(group) == 0 else None


def agree_on_id(store: Any, key: str, rank: int, world_size: int, timeout: float) -> str:
    """A fresh random id chosen by rank 0 and read by every rank (one store round trip)."""
    if world_size == 1 or store is None:
        return uuid.uuid4().hex
    if rank == 0:
        value = uuid.uuid4().hex
        store.set(key, value.encode())
        return value
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as e:   # noqa: BLE001  (the store raises a generic error on timeout)
        raise CheckpointError(f"rank 0 did not publish the save id within {timeout:g} s ({e})",
                              field="save_id") from e
    return store.get(key).decode()
