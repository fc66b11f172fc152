"""The activation-memory model, replayed over a trace's compute rows.

Per rank, bytes held = static bytes + activations of the (stage, microbatch) pairs in flight:

* F adds the stage's ``activation_bytes`` when it starts (it fills them while it runs);
* B frees them all when it ends;
* I frees all but the ``weight_grad_fraction`` share that W needs, when it ends;
* W frees that share when it ends.
* In a trace with no backward at all (forward-only), F's activations are freed at its end.

Frees sort before allocations at the same instant. Static bytes per rank are
``CostModel.static_bytes[rank]`` plus ``stage_static_bytes`` of every stage the rank holds.
Because it reads only the trace, the same model predicts a measured run's memory from its
measured timing.

Receive buffers (with the schedule, when messages have a size, ``p2p_bytes``): a RECV
allocates its buffer when it is posted, i.e. at the start of the first computation after it in
the rank's list. An activation's buffer is part of the stage's ``activation_bytes`` from its
F on, so it adds only while posted ahead of that F (``recv_lookahead``); a gradient's buffer
is held from its posting to the end of the B or I that uses it.

Send buffers (same condition): an F whose output goes to another rank holds that output
(``p2p_bytes`` of its stage) while it runs, on top of its activations: the output is not an
activation the backward needs (the next stage keeps its own copy as its input), and it is
freed once sent (Megatron's ``deallocate_output_tensor``). A B or I's input gradient is not
added: it is made as the backward frees the stage's activations, which already count more.

Local hand-offs (same condition): between two stages on the same rank (the turn of a V, every
boundary at pp 1) nothing is sent, so nothing frees what one stage hands the other early. An
F's output feeding the next stage here is held from that F's start until the next stage's F of
the microbatch starts (from then on it is that stage's input, in its ``activation_bytes``); a B
or I's input gradient feeding the previous stage here is held from its end until the end of the
previous stage's B or I of the microbatch, which consumes it. On ZB-V at pp 2 the turn rank
holds both across other work (the prediction was 1.8% low without them, 11% under full
recomputation).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..schedule.op import (CODE_B, CODE_F, CODE_I, CODE_RECV_B, CODE_RECV_F, CODE_W,
                           FIRST_COMM_CODE, TRACE_OPS)
from ..schedule.program import lower

if TYPE_CHECKING:
    import pandas as pd

    from ..plan.costs import CostModel
    from ..schedule.schedule import Schedule


class ComputeRows(NamedTuple):
    """The arrays of a trace's compute rows of real stages (step-tail rows left out), in trace
    order: what the memory model reads, whether or not a DataFrame was built."""

    rank: np.ndarray
    code: np.ndarray        # op codes (:attr:`Op.code`; -1 for an op the trace names and Op not)
    stage: np.ndarray
    microbatch: np.ndarray
    start: np.ndarray
    end: np.ndarray


class MemoryEvents(NamedTuple):
    """Every allocation and free, sorted by (rank, time, frees first), and the bytes held on
    the rank after each (a running sum per rank, in that order)."""

    rank: np.ndarray
    time: np.ndarray
    held: np.ndarray

    def frame(self) -> "pd.DataFrame":
        import pandas as pd

        return pd.DataFrame({"rank": self.rank, "time": self.time, "bytes": self.held})

    def peaks(self, pp: int) -> list[float]:
        """Largest ``held`` of each rank (0 for a rank without events)."""
        out = [0.0] * pp
        bounds = np.searchsorted(self.rank, np.arange(pp + 1))
        for r in range(pp):
            if bounds[r + 1] > bounds[r]:
                out[r] = float(self.held[bounds[r]:bounds[r + 1]].max())
        return out


def compute_rows(trace: "pd.DataFrame") -> ComputeRows:
    rows = trace[trace["kind"] == "compute"]
    rows = rows[rows["stage"] >= 0]
    return ComputeRows(rows["rank"].to_numpy(int), op_codes(rows["op"]),
                       rows["stage"].to_numpy(int), rows["microbatch"].to_numpy(int),
                       rows["start"].to_numpy(float), rows["end"].to_numpy(float))


def op_codes(ops: "pd.Series") -> np.ndarray:
    """A trace's ``op`` column as :attr:`Op.code` values (-1 for a name that is no Op): the
    categorical's codes when its categories are the trace's own (as the simulator makes it),
    else name by name (a measured trace's strings)."""
    cat = getattr(ops, "cat", None) if str(ops.dtype) == "category" else None
    if cat is not None and tuple(cat.categories) == _TRACE_OP_NAMES:
        return cat.codes.to_numpy(np.int8)
    return np.fromiter((_CODE_OF.get(str(op), -1) for op in ops), dtype=np.int8, count=len(ops))


_TRACE_OP_NAMES = tuple(op.value for op in TRACE_OPS)
_CODE_OF = {op.value: op.code for op in TRACE_OPS}


def memory_timeline(trace: "pd.DataFrame", costs: "CostModel", num_stages: int, pp: int,
                    rank_stages: Sequence[Sequence[int]] | None = None,
                    schedule: "Schedule | None" = None) -> "pd.DataFrame":
    """Columns rank, time, bytes: bytes held on the rank after each event.

    Each rank's timeline starts with its static bytes at the trace's first start. With
    ``schedule``, receive buffers are counted too (see the module docstring).
    """
    return memory_events(compute_rows(trace), float(trace["start"].min()), costs, num_stages,
                         pp, rank_stages, schedule).frame()


def memory_events(rows: ComputeRows, t0: float, costs: "CostModel", num_stages: int, pp: int,
                  rank_stages: Sequence[Sequence[int]] | None = None,
                  schedule: "Schedule | None" = None) -> MemoryEvents:
    """The memory model over the compute rows' arrays; ``t0``: the trace's first start."""
    act = np.asarray(costs.stage_values("activation_bytes", num_stages), float)
    wshare = np.asarray(costs.stage_values("weight_grad_fraction", num_stages), float)
    static_stage = costs.stage_values("stage_static_bytes", num_stages)
    static_rank = costs.rank_static_bytes(pp)
    code, stage, start, end, rank = rows.code, rows.stage, rows.start, rows.end, rows.rank
    if len(stage) and stage.max() >= num_stages:
        raise ValueError(f"trace names stage {stage.max()}, outside 0..{num_stages - 1}")
    is_b, is_i, is_w = code == CODE_B, code == CODE_I, code == CODE_W
    has_backward = bool(is_b.any() or is_i.any() or is_w.any())
    parts = []  # (mask, time, delta, prio)
    is_f = code == CODE_F
    parts.append((is_f, start, act[stage], 1))
    if has_backward:
        parts.append((is_b, end, -act[stage], 0))
        parts.append((is_i, end, -(1 - wshare[stage]) * act[stage], 0))
        parts.append((is_w, end, -wshare[stage] * act[stage], 0))
    else:
        parts.append((is_f, end, -act[stage], 0))
    times = np.concatenate([t[m] for m, t, _, _ in parts])
    deltas = np.concatenate([d[m] for m, _, d, _ in parts])
    prio = np.concatenate([np.full(m.sum(), p) for m, _, _, p in parts])
    ranks = np.concatenate([rank[m] for m, _, _, _ in parts])
    nbytes = costs.stage_values("p2p_bytes", num_stages)
    if schedule is not None and has_backward and any(nbytes):
        extra = _receive_buffers(rows, schedule, nbytes)
        sent = _send_buffers(rows, schedule, nbytes, num_stages)
        if sent is not None:
            m, size = sent
            times = np.concatenate((times, start[m], end[m]))
            deltas = np.concatenate((deltas, size, -size))
            prio = np.concatenate((prio, np.full(m.sum(), 1), np.full(m.sum(), 0)))
            ranks = np.concatenate((ranks, rank[m], rank[m]))
        local = _local_handoffs(rows, schedule, nbytes, num_stages)
        if local:
            local_cols = [np.asarray(x) for x in zip(*local)]
            extra = tuple(np.concatenate((a, c)) for a, c in zip(extra, local_cols))
        r, t, d, p = extra
        if len(r):
            times, deltas = np.concatenate((times, t)), np.concatenate((deltas, d))
            prio, ranks = np.concatenate((prio, p)), np.concatenate((ranks, r))

    if rank_stages is None:
        rank_stages = [list(dict.fromkeys(stage[rank == r].tolist())) for r in range(pp)]
    static = np.array([static_rank[r] + sum(static_stage[s] for s in rank_stages[r]) for r in range(pp)])
    times = np.concatenate((np.full(pp, t0), times))
    deltas = np.concatenate((static, deltas))
    prio = np.concatenate((np.full(pp, -1), prio))
    ranks = np.concatenate((np.arange(pp), ranks))
    order = np.lexsort((prio, times, ranks))
    ranks, deltas = ranks[order], deltas[order]
    held = np.empty_like(deltas)
    bounds = np.searchsorted(ranks, np.arange(pp + 1))
    for r in range(pp):                     # a running sum per rank (events sorted by rank)
        np.cumsum(deltas[bounds[r]:bounds[r + 1]], out=held[bounds[r]:bounds[r + 1]])
    return MemoryEvents(ranks, times[order], held)


def _send_buffers(rows: ComputeRows, schedule: "Schedule", nbytes: Sequence[float],
                  num_stages: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The F rows whose output goes to another rank (the producers of the lowered program's
    forward transfers), and the bytes each holds while it runs."""
    if schedule.num_stages != num_stages:
        return None
    m = schedule.num_microbatches
    sent = np.frombuffer(lower(schedule).sent_forward(), dtype=np.uint8).astype(bool)
    size = np.asarray(list(nbytes), float)
    key = rows.stage * m + np.clip(rows.microbatch, 0, m - 1)
    mask = (rows.code == CODE_F) & (rows.microbatch < m) & sent[np.clip(key, 0, len(sent) - 1)]
    mask &= size[rows.stage] > 0
    if not mask.any():
        return None
    return mask, size[rows.stage[mask]]


def _local_handoffs(rows: ComputeRows, schedule: "Schedule", nbytes: Sequence[float],
                    num_stages: int) -> list[tuple[int, float, float, int]]:
    """(rank, time, +/- bytes, priority) of what a stage hands the next (forward) or the
    previous (backward) stage on its own rank: see the module docstring."""
    if schedule.num_stages != num_stages:
        return []
    # the boundaries whose two stages share a rank: most schedules have none (pp > 1, looped)
    local = [s for s in range(num_stages - 1)
             if schedule.stage_rank(s) == schedule.stage_rank(s + 1) and nbytes[s] > 0]
    if not local:
        return []
    m = schedule.num_microbatches
    sent = lower(schedule).sent_forward()
    near = np.isin(rows.stage, local + [s + 1 for s in local])
    f_start: dict = {}
    back_end: dict = {}
    for r, o, s, b, t0, t1 in zip(rows.rank[near].tolist(), rows.code[near].tolist(),
                                  rows.stage[near].tolist(), rows.microbatch[near].tolist(),
                                  rows.start[near].tolist(), rows.end[near].tolist()):
        if o == CODE_F:
            f_start[(r, s, b)] = t0
        elif o == CODE_B or o == CODE_I:
            back_end[(r, s, b)] = t1
    out: list[tuple[int, float, float, int]] = []
    local_set = set(local)
    for (r, s, b), t in f_start.items():
        if s not in local_set or not 0 <= b < m or sent[s * m + b]:
            continue
        size = float(nbytes[s])
        use = f_start.get((r, s + 1, b))
        if use is not None and use >= t:               # the output, until the next stage's F
            out += [(r, t, size, 1), (r, use, -size, 0)]
        made, used = back_end.get((r, s + 1, b)), back_end.get((r, s, b))
        if made is not None and used is not None and used >= made:   # the input gradient
            out += [(r, made, size, 1), (r, used, -size, 0)]
    return out


def _receive_posts(program) -> tuple[np.ndarray, ...]:
    """Every RECV of ``program`` with the computation that posts it (the first one after it
    in the rank's rows), in row order: arrays ``rank, code, stage, microbatch`` (the posting
    computation), ``recv`` (CODE_RECV_F or CODE_RECV_B), ``stage``, ``microbatch`` (what it
    receives). A pure function of the program (kept with it: ``Program.derived``)."""
    cols: tuple[list[int], ...] = ([], [], [], [], [], [], [])
    ranks, codes, stages, mbs, recvs, recv_stages, recv_mbs = cols
    for rank, lowered in enumerate(program.in_turn):
        posted: list = []                    # the rows of RECVs waiting for a computation
        for r in lowered:
            code = r[0]                                   # a Row: code, stage, microbatch
            if code == CODE_RECV_F or code == CODE_RECV_B:
                posted.append(r)
                continue
            if not posted or code >= FIRST_COMM_CODE:
                continue
            n = len(posted)
            ranks += [rank] * n
            codes += [code] * n
            stages += [r[1]] * n
            mbs += [r[2]] * n
            for p in posted:
                recvs.append(p[0])
                recv_stages.append(p[1])
                recv_mbs.append(p[2])
            posted = []
    out = tuple(np.array(c, dtype=np.int64) for c in cols)
    for c in out:
        c.flags.writeable = False
    return out


def _receive_buffers(rows: ComputeRows, schedule: "Schedule", nbytes: Sequence[float]
                     ) -> tuple[np.ndarray, ...]:
    """(rank, time, +/- bytes, priority) arrays of the receive buffers a schedule's RECVs
    hold, read from its lowered rows (an overlap holds what its parts do): each buffer from
    the start of the computation that posts it to the start of its F (an activation posted
    before another computation) or the end of its B or I (a gradient), as a +/- pair."""
    rank, code, stage, mb, recv, s, b = lower(schedule).derived(_receive_posts)
    empty = np.zeros(0)
    if not len(rank) or not len(rows.rank):
        return empty, empty, empty, empty
    # a computation's (rank, code, stage, microbatch) as one key, looked up in the rows
    # (the last row of a key, as a dict built from them keeps)
    dims = (int(max(rows.rank.max(), rank.max())) + 1,
            int(max(rows.code.max(), code.max(), CODE_W)) + 2,        # codes from -1
            int(max(rows.stage.max(), stage.max(), s.max())) + 1,
            int(max(rows.microbatch.max(), mb.max(), b.max())) + 2)   # microbatches from -1

    def key(r, c, st, m):
        return ((np.asarray(r, np.int64) * dims[1] + (np.asarray(c, np.int64) + 1)) * dims[2]
                + np.asarray(st, np.int64)) * dims[3] + (np.asarray(m, np.int64) + 1)

    keys = key(rows.rank, rows.code, rows.stage, rows.microbatch)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]

    def find(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.searchsorted(sorted_keys, q, side="right") - 1
        ok = at >= 0
        ok[ok] = sorted_keys[at[ok]] == q[ok]
        return ok, order[np.maximum(at, 0)]

    start, end = rows.start, rows.end
    size = np.asarray(list(nbytes), float)
    at_ok, at_row = find(key(rank, code, stage, mb))
    is_f = recv == CODE_RECV_F
    # an activation posted right before its own F is in that stage's activation_bytes
    f_ok, f_row = find(key(rank, CODE_F, s, b))
    own = (code == CODE_F) & (stage == s) & (mb == b)
    take_f = is_f & at_ok & f_ok & ~own
    b_ok, b_row = find(key(rank, CODE_B, s, b))
    i_ok, i_row = find(key(rank, CODE_I, s, b))
    use_b = np.where(b_ok, b_row, i_row)
    take_b = ~is_f & at_ok & (b_ok | i_ok)
    take = take_f | take_b
    nb = np.where(is_f, size[np.clip(s - 1, 0, len(size) - 1)], size[np.clip(s, 0, len(size) - 1)])[take]
    freed = np.where(is_f, start[f_row], end[use_b])[take]
    # each buffer's allocation, then its free, in the RECVs' order
    times = np.column_stack((start[at_row[take]], freed)).ravel()
    deltas = np.column_stack((nb, -nb)).ravel()
    prio = np.tile(np.array([1, 0]), int(take.sum()))
    return np.repeat(rank[take], 2), times, deltas, prio


def peak_per_rank(timeline: "pd.DataFrame", pp: int) -> list[float]:
    """Largest ``bytes`` of each rank in a timeline with columns rank, time, bytes."""
    peaks = timeline.groupby("rank")["bytes"].max()
    return [float(peaks.get(r, 0.0)) for r in range(pp)]
