"""The search without CPython's full garbage collections.

A search keeps hundreds of MB of built schedules and lowered programs (tuples of ints, the
build cache's), and CPython runs a full collection, a pass over every tracked object, each
time the objects surviving the young collections grow by a quarter of the old ones. The
Llama 3 405B search on 16,384 H100s ran 50 of them, 0.14 s each: 7 of its 45 CPU seconds,
for garbage a search hardly makes (reference counting frees what it drops; its schedules and
programs hold no cycles). Young collections (generations 0 and 1) still run, so a cycle made
and dropped during the search is still found; the collector's settings come back after.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# gen-1 collections before a full one is considered: more than any search makes
_NEVER = 1 << 30


@contextmanager
def full_collections_paused() -> Iterator[None]:
    """Inside: no automatic full collection (generation 2); the thresholds restored after."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def pause_full_collections() -> None:
    """The same for the rest of a process that only searches (a pool's worker)."""
    t0, t1, _ = gc.get_threshold()
    gc.set_threshold(t0, t1, _NEVER)
