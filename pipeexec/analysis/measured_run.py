"""The measured trace: every rank's action records, on one clock, as a pipesim trace.

`build_trace` turns the per-rank `ActionRecord` lists (gathered on rank 0) into a DataFrame
with the simulator's columns (`pipesim.sim.trace.TRACE_COLUMNS`) plus ``step``, ``mem_start``,
``mem_end``, ``arrival_observed``, ``link_start``, ``compute_start`` and ``cpu``, so ``SimResult.from_trace`` scores and draws it exactly
as it does a simulated step. Rows mean what they mean in the simulator, where a rank runs its computations back to back
and only waits for messages:

* F/B/I/W: from when the rank was free to start it (the end of its previous computation, but
  not before its input was sent, or the arrival of its input if it had to wait for it) to its
  end. So a computation includes
  the executor's own work since the previous one (posting sends and receives, bookkeeping):
  busy time is time spent on the schedule, idle time is time spent waiting for a peer. The
  computation proper starts at ``compute_start``.
* RECV_F/RECV_B: the time the rank waited for the message: from when it was free to the
  arrival (the wait happens inside the computation that needs the data); zero-length at the
  moment it took the data when the data was already there. Its ``mem_*`` are the readings
  around posting the receive (the buffer it allocated).
* SEND_F/SEND_B: from the moment the send was posted to the message's arrival. The arrival is
  seen exactly when the receiver was waiting for it (the wait ended when it arrived:
  ``arrival_observed`` is True); otherwise the data was already there when the receiver took
  it, and the row ends at that moment, an upper bound of the arrival. ``link_start`` is when
  both sides had posted (the later posting), the start of the transfer proper.

* UNSHARD / REDUCE_GRAD (ZeRO-2/3's collectives, :mod:`pipesim.schedule.sharding`): the
  runtime runs each in its place in the program, the rank waiting for it (the simulator's
  ``CostModel.overlap_sharding`` 0), so like a computation: from when the rank was free (the
  end of its previous computation or sharding action, the executor's work since included) to
  its end; the next computation starts no earlier. RESHARD (a release, free in the model): its
  own duration, from when the rank was free; the executor's work before it (the sends posted
  after its computation) stays in the next row, which a model without a RESHARD price still
  holds. Kind "comm", no peer, no bytes, as the simulator's rows.

``cpu`` (compute rows of CPU runs): the CPU seconds the rank's thread used over the same span
(from the end of its previous computation), i.e. its work without the time it lost to other
processes sharing its core (waits block and use none).

`MeasuredRun` holds the trace of all profiled steps with the run's layout, and gives each
step's trace, memory timeline and `SimResult`; ``save`` writes a Chrome/Perfetto JSON, the
table as CSV beside it, and a small ``.meta.json`` with the layout (what calibration of a
different partition needs).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pipesim
from pipesim.sim.chrome import chrome_trace as chrome_events
from pipesim.sim.result import SimResult
from pipesim.schedule.action import (B, F, I, RECV_B, RECV_F, RESHARD, SEND_B, SEND_F, SHARD_OPS,
                                     W)

from .profile_meta import KEYS as MEASUREMENT_KEYS, Measurement
from .run_plan import RunPlan, schedule_from_meta

if TYPE_CHECKING:
    import pandas as pd

    from ..measuring.recorder import ActionRecord

COLUMNS = ("rank", "op", "stage", "chunk", "microbatch", "start", "end", "kind", "bytes", "peer",
           "step", "mem_start", "mem_end", "arrival_observed", "link_start", "compute_start", "cpu")
# A receive wait shorter than this found the data already there (the call itself takes µs).
WAIT_EPS = 1e-4
_COMPUTE = (F, B, I, W)
_PLAN_KEYS = ("schedule", "pp", "vpp", "dp", "microbatches", "recv_lookahead", "bounds",
              "layer_kinds", "device", "backend", "rank_cpus", "host_cpus", "cpus_per_rank",
              "hosts", "config")


def build_trace(records: Sequence[Sequence[ActionRecord]], offsets: Sequence[float],
                schedule: "pipesim.Schedule") -> "pd.DataFrame":
    """One DataFrame from ``records[pp_rank]`` (local clocks) and ``offsets[pp_rank]``.

    Times are on rank 0's clock, shifted so the first profiled action starts at 0. Raises
    ValueError naming the rank and action when a record does not fit the schedule.
    """
    import pandas as pd

    placement = schedule.placement
    rows: list[list] = []
    recv_rows: dict[tuple, list] = {}      # (step, op, stage, mb) -> row
    post: dict[tuple, tuple] = {}           # RECV action records: key -> (rank, record, offset)
    sends: list[tuple[list, tuple]] = []
    real_wait: dict[tuple, float] = {}      # RECV key -> seconds actually spent in wait()
    early: list[tuple[list, tuple]] = []    # computations that did not wait for their input
    for rank, (recs, off) in enumerate(zip(records, offsets)):
        step, free_at, cpu_free = None, 0.0, math.nan
        for rec in recs:
            op, s, mb = rec.op, rec.stage, rec.microbatch
            if placement[s] != rank:
                raise ValueError(f"rank {rank} recorded {s}{op}{mb} (step {rec.step}) but stage "
                                 f"{s} is on rank {placement[s]}")
            chunk = schedule.stage_chunk(s)
            t0, t1 = rec.start + off, rec.end + off
            if rec.step != step:
                step, free_at, cpu_free = rec.step, t0, rec.cpu_start
            if op in _COMPUTE:
                begin, raw = free_at, t0
                if not math.isnan(rec.wait_start):
                    w0, w1 = rec.wait_start + off, rec.wait_end + off
                    rop = RECV_F if op == F else RECV_B
                    peer = placement[s - 1] if rop == RECV_F else placement[s + 1]
                    key = (rec.step, rop, s, mb)
                    real_wait[key] = w1 - w0
                    waited = w1 - w0 > WAIT_EPS
                    row = [rank, rop, s, chunk, mb, free_at if waited else w1, w1, "comm", 0,
                           peer, rec.step, math.nan, math.nan, False, math.nan, math.nan,
                           math.nan]
                    recv_rows[key] = row
                    rows.append(row)
                    raw = w1
                    if waited:
                        begin = w1
                row = [rank, op, s, chunk, mb, begin, t1, "compute", 0, -1, rec.step,
                       rec.mem_start, rec.mem_end, False, math.nan, raw,
                       rec.cpu_end - cpu_free]
                rows.append(row)
                if raw != begin and not math.isnan(rec.wait_start):
                    early.append((row, key))
                free_at, cpu_free = t1, rec.cpu_end
            elif op in (RECV_F, RECV_B):
                post[(rec.step, op, s, mb)] = (rank, rec, off)
            elif op in (SEND_F, SEND_B):
                peer = placement[s + 1] if op == SEND_F else placement[s - 1]
                row = [rank, op, s, chunk, mb, t0, t1, "comm", rec.nbytes, peer, rec.step,
                       rec.mem_start, rec.mem_end, False, math.nan, math.nan, math.nan]
                rows.append(row)
                key = (rec.step, RECV_F, s + 1, mb) if op == SEND_F else (rec.step, RECV_B, s - 1, mb)
                sends.append((row, key))
            elif op in SHARD_OPS:
                # ZeRO's UNSHARD / REDUCE_GRAD: the rank runs each in its place and waits for
                # its collective, so, as a computation, from when it was free; a RESHARD (free
                # in the model) keeps its own time only, from then: the executor's work before
                # it stays with the next row, as without sharding
                end = t1 if op != RESHARD else free_at + (t1 - t0)
                row = [rank, op, s, chunk, mb, free_at, end, "comm", 0, -1, rec.step,
                       rec.mem_start, rec.mem_end, False, math.nan, math.nan, math.nan]
                rows.append(row)
                free_at = end
                cpu_free = (rec.cpu_end if op != RESHARD
                            else cpu_free + (rec.cpu_end - rec.cpu_start))
            else:
                raise ValueError(f"rank {rank}: unknown op {op!r} in the profile")
    # Receives: bytes from the posting action; a posted receive nobody waited on keeps its
    # posting span (forward-only steps do not occur in training, but stay well-formed).
    for key, (rank, rec, off) in post.items():
        row = recv_rows.get(key)
        if row is None:
            row = [rank, rec.op, rec.stage, schedule.stage_chunk(rec.stage), rec.microbatch,
                   rec.start + off, rec.end + off, "comm", rec.nbytes,
                   placement[rec.stage - 1] if rec.op == RECV_F else placement[rec.stage + 1],
                   rec.step, rec.mem_start, rec.mem_end, False, math.nan, math.nan, math.nan]
            rows.append(row)
            recv_rows[key] = row
        else:
            row[8] = rec.nbytes
            row[11], row[12] = rec.mem_start, rec.mem_end   # the posting's readings
    send_start: dict[tuple, float] = {}
    for row, key in sends:
        recv = recv_rows.get(key)
        if recv is None:
            continue
        waited = real_wait.get(key, 0.0) > WAIT_EPS
        arrival = recv[6]
        row[6] = max(row[6], arrival)
        row[13] = waited
        posted = post.get(key)
        # Both sides ready: the later of the send's and the receive's posting.
        row[14] = row[5] if posted is None else max(row[5], posted[1].start + posted[2])
        send_start[key] = row[5]
    # A computation whose input was already there starts no earlier than the input was sent:
    # the executor work before that was done while waiting for the peer.
    for row, key in early:
        if key in send_start:
            row[5] = min(max(row[5], send_start[key]), row[15])
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    if len(frame) == 0:
        raise ValueError("the profile recorded no actions (is the step range inside the run?)")
    t0 = float(frame["start"].min())
    for c in ("start", "end", "link_start", "compute_start"):
        frame[c] -= t0
    return _shift(frame)


def step_origin(rows: "pd.DataFrame") -> float:
    """When one step's rows begin, as a simulation's: the first computation's start, or a
    sharding action's before it (ZeRO-3's first UNSHARD, which the simulator runs at 0 with
    the computation waiting for it); receive waits before it are not the schedule's."""
    own = (rows["kind"] == "compute") | rows["op"].astype(str).isin(SHARD_OPS)
    return float(rows.loc[own, "start"].min())


def _shift(frame: "pd.DataFrame") -> "pd.DataFrame":
    """Sort by step, rank and start; int columns typed."""
    for c in ("rank", "stage", "chunk", "microbatch", "bytes", "peer", "step"):
        frame[c] = frame[c].astype("int64")
    frame["arrival_observed"] = frame["arrival_observed"].astype(bool)
    return frame.sort_values(["step", "rank", "start", "end"], kind="stable").reset_index(drop=True)


@dataclass
class MeasuredRun:
    """All profiled steps of one run. ``meta`` is the run's ``.meta.json`` as stored (flat);
    code reads it through two typed views: ``plan`` (the `RunPlan`: schedule as data, bounds,
    layer kinds, hosts and CPU shares, config) and ``measurement`` (the `Measurement`: clock
    offsets and round trips per pipeline rank, profiled steps, split probes). Torch-free: a run
    saved on a training machine is calibrated and compared anywhere."""

    trace: "pd.DataFrame"
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_plan(cls, trace: "pd.DataFrame", plan: RunPlan,
                measurement: Measurement | None = None, **fields: Any) -> "MeasuredRun":
        """A run of ``plan`` with ``measurement`` (or its fields given by name)."""
        if measurement is None:
            measurement = Measurement(**fields)
        elif fields:
            raise TypeError("of_plan: give a Measurement or its fields, not both")
        return cls(trace, {**plan.to_meta(), **measurement.to_meta()})

    @property
    def plan(self) -> RunPlan:
        """What ran, read from ``meta`` (re-read when ``meta``'s plan keys change)."""
        key = (id(self.meta.get("schedule_data")),) + tuple(
            repr(self.meta.get(k)) for k in _PLAN_KEYS)
        cached = self.__dict__.get("_plan_cache")
        if cached is None or cached[0] != key:
            cached = (key, RunPlan.from_meta(self.meta))
            self.__dict__["_plan_cache"] = cached
        return cached[1]

    @property
    def measurement(self) -> Measurement:
        """What the profiler recorded besides the trace, read from ``meta`` (re-read when
        those keys change)."""
        key = tuple(repr(self.meta.get(k)) for k in MEASUREMENT_KEYS)
        cached = self.__dict__.get("_measurement_cache")
        if cached is None or cached[0] != key:
            cached = (key, Measurement.from_meta(self.meta))
            self.__dict__["_measurement_cache"] = cached
        return cached[1]

    def layer_shares(self, clock: str = "wall") -> dict[int, dict[str, dict[str, float]]]:
        """``{stage: {kind: {op: share}}}``: what the embedding or head alone cost of its stage's
        F, B, I and W on ``clock`` ("wall" or "cpu"), from the meta's ``layer_probe``
        (`pipeexec.measuring.probe.probe_layers`); empty for runs recorded without it. Non-finite
        shares (a CPU clock on a GPU) are left out."""
        out: dict[int, dict[str, dict[str, float]]] = {}
        for s, kinds in (self.meta.get("layer_probe") or {}).items():
            for kind, probe in kinds.items():
                shares = {op: float(v) for op, v in (probe.get(f"share_{clock}") or {}).items()
                          if v is not None and math.isfinite(float(v))}
                if shares:
                    out.setdefault(int(s), {})[kind] = shares
        return out

    @property
    def schedule(self) -> "pipesim.Schedule":
        """The schedule the run ran: recorded as data (``schedule_data``), or rebuilt from its
        name by runs recorded before that (the plan's, when the meta holds a whole plan)."""
        if "bounds" in self.meta:
            return self.plan.schedule
        return schedule_from_meta(self.meta)

    @property
    def steps(self) -> list[int]:
        return sorted(int(s) for s in self.trace["step"].unique())

    def step_trace(self, step: int) -> "pd.DataFrame":
        """The rows of one step, times from the step's first computation (or ZeRO-3's first
        gather, `step_origin`).

        As in a simulation, the step starts with the first compute (a sharded program's first
        UNSHARD before it); a rank that entered the step earlier and waited for its first input
        has that wait clipped to the step start (the wait measures when the previous step's
        tail let the rank go, not the schedule).
        """
        rows = self.trace[self.trace["step"] == step]
        if len(rows) == 0:
            raise ValueError(f"step {step} was not profiled (profiled: {self.steps})")
        rows = rows.copy()
        t0 = step_origin(rows)
        for c in ("start", "end", "link_start", "compute_start"):
            if c in rows.columns:
                rows[c] = (rows[c] - t0).clip(lower=0.0)
        return rows.reset_index(drop=True)

    def memory_timeline(self, step: int) -> "pd.DataFrame":
        """Columns rank, time, bytes: the meter's readings at the start and end of every
        compute and send. (A RECV row carries the readings of posting the receive, which
        happened before the wait the row spans, so it is left out of the timeline.)"""
        import pandas as pd

        rows = self.step_trace(step)
        rows = rows[~rows["op"].isin(("RECV_F", "RECV_B"))]
        a = rows[["rank", "start", "mem_start"]].set_axis(["rank", "time", "bytes"], axis=1)
        b = rows[["rank", "end", "mem_end"]].set_axis(["rank", "time", "bytes"], axis=1)
        tl = pd.concat([a, b]).dropna()
        return tl.sort_values(["rank", "time"], kind="stable").reset_index(drop=True)

    def has_memory(self) -> bool:
        return bool(self.trace["mem_end"].notna().any())

    def result(self, step: int | None = None) -> "SimResult":
        """A `SimResult` of one step (default: `representative_step`)."""
        step = self.representative_step() if step is None else step
        tl = self.memory_timeline(step) if self.has_memory() else None
        return SimResult.from_trace(self.step_trace(step), schedule=self.schedule,
                                    memory_timeline=tl)

    def makespans(self) -> dict[int, float]:
        """Each profiled step's makespan (as `step_trace` times it)."""
        out = {}
        for s in self.steps:
            rows = self.trace[self.trace["step"] == s]
            t0 = step_origin(rows)
            out[s] = float(rows["end"].max() - t0)
        return out

    def representative_step(self) -> int:
        """The profiled step with the median makespan (the lower median for an even count)."""
        spans = self.makespans()
        order = sorted(spans, key=lambda s: (spans[s], s))
        return order[(len(order) - 1) // 2]

    def central_steps(self) -> list[int]:
        """The profiled steps without the quarter with the longest and the quarter with the
        shortest makespan (none dropped below 4 steps), in step order: what comparisons and
        calibrations average over, so that one stalled step (another process, a page-cache
        flush) neither moves the measured mean nor the calibrated costs."""
        spans = self.makespans()
        order = sorted(spans, key=lambda s: (spans[s], s))
        k = len(order) // 4
        return sorted(order[k:len(order) - k])

    # -- files ------------------------------------------------------------------------------------
    @staticmethod
    def paths(path: str | Path) -> tuple[Path, Path, Path]:
        """(Chrome JSON, CSV table, meta JSON) for ``run.json``, ``run.csv`` or ``run``."""
        p = Path(path)
        name = p.name
        for suffix in (".meta.json", ".json", ".csv"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        base = p.with_name(name)
        return (base.with_name(name + ".json"), base.with_name(name + ".csv"),
                base.with_name(name + ".meta.json"))

    def save(self, path: str | Path) -> tuple[Path, Path, Path]:
        """Write the Chrome/Perfetto trace (all profiled steps), the CSV and the meta JSON."""
        chrome, csv, meta = self.paths(path)
        chrome.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(chrome, json.dumps(self.chrome_trace()))
        tmp = csv.with_name(csv.name + ".tmp")
        self.trace.to_csv(tmp, index=False)
        tmp.replace(csv)
        _atomic_write(meta, json.dumps(self.meta, indent=1, default=str))
        return chrome, csv, meta

    @classmethod
    def load(cls, path: str | Path) -> "MeasuredRun":
        """Read a run written by `save` (any of its three paths)."""
        import pandas as pd

        chrome, csv, meta = cls.paths(path)
        if not Path(path).exists() and not csv.exists() and not meta.exists():
            raise FileNotFoundError(f"measured run {path}: no such file in {Path.cwd()} (a "
                                    "profiled run (--profile A:B --trace-out NAME.json) is saved "
                                    "as NAME.json, NAME.csv and NAME.meta.json; the main job "
                                    "writes out/run_1f1b.json in the repository's folder)")
        for p in (csv, meta):
            if not p.exists():
                raise FileNotFoundError(f"measured run {path}: {p} is missing beside it (a run "
                                        f"is saved as <name>.json, <name>.csv and "
                                        f"<name>.meta.json)")
        trace = pd.read_csv(csv)
        missing = [c for c in COLUMNS if c not in trace.columns]
        if missing:
            raise ValueError(f"{csv}: missing column(s) {', '.join(missing)}")
        trace["op"] = trace["op"].astype(str)
        trace["kind"] = trace["kind"].astype(str)
        try:
            info = json.loads(meta.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{meta}: not valid JSON: {exc}") from None
        for key in ("schedule", "pp", "vpp", "microbatches"):
            if key not in info:
                raise ValueError(f"{meta}: lacks {key!r}")
        RunPlan.from_meta(info, source=str(meta))      # a bad plan fails here, naming the file
        try:
            Measurement.from_meta(info)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"{meta}: unreadable measurement keys "
                             f"({', '.join(MEASUREMENT_KEYS)}): {exc}") from None
        return cls(_shift(trace), info)

    def chrome_trace(self) -> dict:
        """Chrome trace events of every profiled step on one time axis (flows per step)."""
        events: list[dict] = []
        seen_meta: set[str] = set()
        t_first = float(self.trace["start"].min())
        for k, step in enumerate(self.steps):
            rows = self.trace[self.trace["step"] == step]
            shift = (float(rows["start"].min()) - t_first) * 1e6
            for ev in chrome_events(rows)["traceEvents"]:
                if ev["ph"] == "M":
                    key = json.dumps(ev, sort_keys=True)
                    if key in seen_meta:
                        continue
                    seen_meta.add(key)
                    events.append(ev)
                    continue
                ev = dict(ev)
                ev["ts"] = ev["ts"] + shift
                if "id" in ev:
                    ev["id"] = ev["id"] + 1_000_000 * k
                if ev["ph"] == "X":
                    ev.setdefault("args", {})["step"] = step
                events.append(ev)
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
