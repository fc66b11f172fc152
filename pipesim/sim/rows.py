"""A lowered program's rows as the index arrays a simulated result reads, made once a program.

Which rank each row belongs to, which rows are computations, and the op code, stage and
microbatch of those depend on the schedule alone, not on the costs or the run. Made again on
every call they cost more than simulating a small schedule; kept with the program
(:meth:`pipesim.schedule.program.Program.derived`) they cost a lookup. Read-only arrays: every
result of the same schedule shares them.
"""
from __future__ import annotations

from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from ..schedule.op import FIRST_COMM_CODE
from ..schedule.program import Program


class RowArrays(NamedTuple):
    """``row_rank``: each row's rank (rank-major row order, the trace's). ``compute_rows``: the
    computations' rows (ascending; an overlap's parts in turn), with their ``compute_rank``,
    ``compute_code`` (:attr:`Op.code`), ``compute_stage`` and ``compute_microbatch``.
    ``first_compute`` / ``last_compute``: per rank, its first and last computation's row (-1 for
    a rank without one, those ranks in ``idle_ranks``). ``by_rank``: each rank's computations'
    rows, as tuples (for loops in Python over a small schedule). A rank runs its rows in turn on its own clock, so its computations'
    starts and ends never decrease from one to the next: the first starts earliest and the last
    ends latest."""

    row_rank: np.ndarray
    compute_rows: np.ndarray
    compute_rank: np.ndarray
    compute_code: np.ndarray
    compute_stage: np.ndarray
    compute_microbatch: np.ndarray
    first_compute: np.ndarray
    last_compute: np.ndarray
    idle_ranks: np.ndarray
    by_rank: tuple[tuple[int, ...], ...]


def row_arrays(program: Program) -> RowArrays:
    """The program's :class:`RowArrays`, made on first use and kept with it."""
    return program.derived(_make_row_arrays)


def _make_row_arrays(program: Program) -> RowArrays:
    per_rank = [len(rows) for rows in program.in_turn]
    row_rank = np.repeat(np.arange(program.pp, dtype=np.int64), per_rank)
    flat = [r for r in chain.from_iterable(program.in_turn) if r[0] < FIRST_COMM_CODE]
    count = len(flat)
    compute_rows = np.fromiter(chain.from_iterable(program.compute_rows()), dtype=np.int64,
                               count=count)
    compute_rank = row_rank[compute_rows]
    first = np.full(program.pp, -1, dtype=np.int64)
    last = np.full(program.pp, -1, dtype=np.int64)
    for rank, rows in enumerate(program.compute_rows()):
        if rows:
            first[rank], last[rank] = rows[0], rows[-1]
    arrays = RowArrays(
        row_rank, compute_rows, compute_rank,
        np.fromiter(map(itemgetter(0), flat), dtype=np.int8, count=count),
        np.fromiter(map(itemgetter(1), flat), dtype=np.int64, count=count),
        np.fromiter(map(itemgetter(2), flat), dtype=np.int64, count=count),
        first, last, np.flatnonzero(first < 0),
        tuple(tuple(rows) for rows in program.compute_rows()))
    for array in arrays[:-1]:
        array.flags.writeable = False
    return arrays
